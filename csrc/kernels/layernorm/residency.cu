// Host-side cache of occupancy queries for the persistent layernorm kernels.
#include <mutex>
#include <vector>

#include "pipeline.cuh"

namespace tk_layernorm {

Residency residency(const void* kernel, int block, size_t smem) {
  struct Entry {
    const void* kernel;
    int block, device;
    size_t smem;
    Residency r;
  };
  static std::mutex lock;
  static std::vector<Entry> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return {};
  const std::lock_guard<std::mutex> guard(lock);
  for (const Entry& e : cache)
    if (e.kernel == kernel && e.block == block && e.device == device && e.smem == smem) return e.r;
  Residency r;
  int optin = 0;
  cudaFuncAttributes attr{};
  cudaDeviceGetAttribute(&r.sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (r.sms <= 0) r.sms = 1;
  if (cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && smem + attr.sharedSizeBytes <= size_t(optin) &&
      // the largest allowance, not `smem`: another operand count may launch the same kernel with more
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - int(attr.sharedSizeBytes)) ==
          cudaSuccess &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.per_sm, kernel, block, smem) == cudaSuccess) {
    if (r.per_sm < 0) r.per_sm = 0;
  } else {
    r.per_sm = 0;
  }
  cudaGetLastError();  // a refused configuration is an answer here, not an error for the next launch
  cache.push_back({kernel, block, device, smem, r});
  return r;
}

size_t smem_for_residency(size_t smem, int per_sm) {
  static std::mutex lock;
  static int sm_bytes[64] = {}, reserved[64] = {};
  int device = 0;
  if (per_sm <= 0 || cudaGetDevice(&device) != cudaSuccess || device >= 64) return smem;
  {
    const std::lock_guard<std::mutex> guard(lock);
    if (sm_bytes[device] == 0) {
      cudaDeviceGetAttribute(&sm_bytes[device], cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
      cudaDeviceGetAttribute(&reserved[device], cudaDevAttrReservedSharedMemoryPerBlock, device);
    }
  }
  // per_sm + 1 blocks of (pad + the per-block reservation) bytes exceed the SM's shared memory.
  const long long pad = (long long)sm_bytes[device] / (per_sm + 1) - reserved[device] + 1;
  return pad > (long long)smem ? size_t(pad) : smem;
}

}  // namespace tk_layernorm
