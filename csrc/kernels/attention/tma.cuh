// Host-side TMA descriptor creation, driver entry point fetched at run time
// (no libcuda link at build time).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "attention.h"

namespace tk_attn {

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A 4-D (D, S, H, B) map over a View4 with a (64 x rows) box and 128-byte
// swizzle; rows past S read as zero, which is how sequence tails are padded.
inline const char* make_map(CUtensorMap* map, DType dt, const View4& t, int box_rows) {
  auto fn = encode_fn();
  if (!fn) return "could not get cuTensorMapEncodeTiled from the driver";
  const int esize = 2;
  cuuint64_t dims[4] = {(cuuint64_t)t.D, (cuuint64_t)t.S, (cuuint64_t)t.H, (cuuint64_t)t.B};
  cuuint64_t strides[3] = {(cuuint64_t)(t.ss * esize), (cuuint64_t)(t.sh * esize), (cuuint64_t)(t.sb * esize)};
  // Size-1 dims may carry any stride (torch gives them arbitrary ones); TMA wants 16-byte multiples.
  if (t.S == 1) strides[0] = ((t.D * esize + 15) / 16) * 16;
  if (t.H == 1) strides[1] = strides[0] * t.S;
  if (t.B == 1) strides[2] = strides[1] * t.H;
  cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
  cuuint32_t estr[4] = {1, 1, 1, 1};
  CUresult r = fn(map, dt == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                  const_cast<void*>(t.ptr), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled failed (pointer or strides not 16-byte aligned?)";
}

// fp32 (D, rows, BH) map with a (32 x 64) box, 128-byte swizzle: the dq
// accumulator, written by bulk reduce-add.
inline const char* make_map_f32(CUtensorMap* map, float* ptr, int64_t D, int64_t rows, int64_t BH) {
  auto fn = encode_fn();
  if (!fn) return "could not get cuTensorMapEncodeTiled from the driver";
  cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)rows, (cuuint64_t)BH};
  cuuint64_t strides[2] = {(cuuint64_t)(D * 4), (cuuint64_t)(rows * D * 4)};
  cuuint32_t box[3] = {32, 64, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, ptr, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled failed for the dq accumulator";
}

}  // namespace tk_attn
