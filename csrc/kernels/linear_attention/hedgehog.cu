// Hedgehog linear attention, forward: plain_forward.cuh's scan with φ(x) = cat(softmax(x W), softmax(-x W)) computed
// per chunk from the loaded q and k (plain.cuh's hedgehog_features), for dk 64 or 128 columns and F 64 or 128 features.
#include "plain_forward.cuh"

namespace tk_linear_attention {

const char* launch_hedgehog(const PlainArgs& a, cudaStream_t stream) {
  bool empty = false;
  if (const char* e = check_forward(a, empty)) return e;
  if (empty) return nullptr;  // nothing to compute
  if (a.map != FeatureMap::hedgehog) return "launch_hedgehog runs the Hedgehog map only";
  constexpr FeatureMap M = FeatureMap::hedgehog;
  if (a.dk == 64) {
    if (a.features == 64) return launch_fwd<64, 64, M>(a, stream);
    if (a.features == 128) return launch_fwd<128, 64, M>(a, stream);
  } else if (a.dk == 128) {
    if (a.features == 64) return launch_fwd<64, 128, M>(a, stream);
    if (a.features == 128) return launch_fwd<128, 128, M>(a, stream);
  }
  return "Hedgehog takes dk 64 or 128 and 64 or 128 features";
}

}  // namespace tk_linear_attention
