// Plain linear attention with the elementwise feature maps (identity, elu + 1), forward: the instances of
// plain_forward.cuh's scan.
#include "plain_forward.cuh"

namespace tk_linear_attention {

const char* launch_plain(const PlainArgs& a, cudaStream_t stream) {
  bool empty = false;
  if (const char* e = check_forward(a, empty)) return e;
  if (empty) return nullptr;  // nothing to compute
  if (a.dk != a.features) return "the elementwise maps' features are q's and k's columns";
  return dispatch_plain(a.features, a.map, [&]<int F, FeatureMap M>() { return launch_fwd<F, F, M>(a, stream); });
}

}  // namespace tk_linear_attention
