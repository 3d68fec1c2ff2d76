// Hedgehog linear attention, forward: plain_forward.cuh's scan with φ(x) = cat(softmax(x W), softmax(-x W)) computed
// per chunk from the loaded q and k (plain.cuh's hedgehog_features), for dk 64 or 128 columns and F 64 or 128 features.
#include "plain_forward.cuh"

namespace tk_linear_attention {

const char* launch_hedgehog(const PlainArgs& a, cudaStream_t stream) {
  bool empty = false;
  if (const char* e = check_forward(a, empty)) return e;
  if (empty) return nullptr;  // nothing to compute
  if (a.map != FeatureMap::hedgehog) return "launch_hedgehog runs the Hedgehog map only";
  return dispatch_hedgehog(a.dk, a.features,
                           [&]<int F, int D>() { return launch_fwd<F, D, FeatureMap::hedgehog>(a, stream); });
}

}  // namespace tk_linear_attention
