// Launch interface of the layernorm family (torch-free; the binding includes it).
// h = residual + dropout(x); y = LayerNorm(h)·w + b, or RMSNorm y = h·rsqrt(mean(h²)+eps)·w.
// All tensors are row-major (rows, hidden), 16-byte aligned; absent optional tensors are nullptr.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace tk_layernorm {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };
constexpr int kMaxHidden = 16384;  // hidden % 8 == 0 and hidden <= kMaxHidden

// Kernel variants (the binding reads TK_LN_FWD_VARIANT / TK_LN_BWD_VARIANT; see kDefault*Variant):
//   0  "legacy": each thread holds its rows' loads in registers (the first version).
//   forward 1..3: persistent grid, rows staged 2 / 3 / 4 deep in shared memory with cp.async.
//   forward 4, 5: the legacy kernel with one row per block, 1 / 2 vectors per thread (few rows in flight,
//     many short blocks: the shape of torch.compile's kernel, which beat legacy at hidden 1024).
//   forward 6: persistent, 2 stages, the row kept in shared memory only and w / b re-read: <= 64 registers.
//   forward 7: legacy, its own split, one row per block (32-thread blocks up to hidden 1024).
//   forward 8: 5 with w and b loaded together with x and the residual, and h stored with y at the end
//     (torch.compile's order), where its block has at most 64 threads (hidden <= 1024); 5 elsewhere.
//   tried and removed (H200, 2026-11-30): 7 in that order (Inductor's own split, a warp per row at 1024: 130.5 us
//     against 7's 130.2 and Inductor's 127.6).
//   tried and removed: forward 8, 5 with evict-first (.cs) x/residual/h/y, 89-93% of copy vs 5's 94-98% (H200, 2026-11-29).
//   backward 1..3: persistent grid, rows staged 3 deep in shared memory with cp.async; 1 vector per thread
//     with registers for 1024 resident threads per SM (1) or 768 (2); 2 vectors per thread, 512 threads (3).
//   backward 4, 5: 4 vectors per thread (a warp per row up to hidden 1024: no block barrier per row),
//     128-thread blocks, 384 threads per SM, 3 (4) or 2 (5) stages; variant 3 past hidden 8192.
//   backward 6: variant 3 with row-group (named) barriers instead of block barriers (hidden 513..2048,
//     where a block holds several multi-warp rows; variant 3 elsewhere).
//   backward 7: variant 3 with the row's dy and x̂ kept in registers between the row sums and the second
//     pass, and w in fp32 registers. Variant 3 past hidden 8192 (1024-thread blocks: 64 registers).
//   backward 8, 9: variant 7 in blocks of >= 128 threads (8) or of one row each (9): more, smaller blocks
//     (at hidden 1024, 8: two rows a block, 4 blocks per SM; 9: 8 blocks of 64 threads per SM).
//   backward 10: 8 with w loaded after the first copies are issued, the row statistics copied by one lane per
//     warp (not by every thread), no w area in shared memory and evict-first dres / dx stores (LEAN in
//     backward_pipe.cuh).
//   backward 11: 10 with at most 256 resident threads per SM (two blocks at hidden <= 2048) at hidden 513..4096;
//     variant 8 elsewhere.
//   tried and removed (H200, 2026-11-30): 7 keeping g = dy·w and summing dw/db in the first pass (fewer
//     instructions, 4% slower at 8192), 7 with 4 stages (no faster), 7 with 4 vectors per thread (spills),
//     7 with a dynamically balanced tail (SMs evened out, kernel 19-34% slower); 8's kernel on a chunked grid,
//     a contiguous 32-row chunk per block, clusters of 4 or 8 blocks adding their dw/db sums through
//     distributed shared memory into one partial row (048656e: 152 vs 139 us at hidden 1024, 1234 vs 991 us at
//     8192; the persistent grid's blocks sweep the rows together, chunks scatter the reads over the tensors).
//   tried outside the library (session 15, RESULTS.md): 10 with row groups claimed from a counter (SMs evened out,
//     calls 2-6% slower), with L2::256B prefetch or evict-first loads, one or four rows per block, 4-8 stages.
// A pipe variant whose staging does not fit in shared memory (fp32 at the largest hidden sizes), or that
// would count rows past 2^31, runs legacy.
constexpr int kForwardVariants = 9, kBackwardVariants = 12;
// From the H200 sweeps (RESULTS.md): the legacy kernel with one row per block and 2 vectors per thread (5)
// reached 94-98% of copy against 92-97% for legacy (0) and 85-90% for the pipe forwards; the 2-vector pipe
// backward (3) reached 82-92% of copy against 47-65% for the legacy one (4, 5 and 6 within 2% of it); keeping
// the row in registers (7) took hidden 8192 from 90% to 101% of copy (the reads outnumber the writes 3:1, which
// HBM serves faster than copy's 1:1), 1024 from 82% to 84%, and stayed within 1% at 2048 and 4096; 7 in
// smaller blocks (8) evens out the SMs' share of rows: 83 -> 85% at 1024, 89 -> 91% at 2048, equal or better
// elsewhere, while one row per block (9) lost at 1024 (77%): its dw/db partial rows cost more than they even out.
// Forward 8 (5 in torch.compile's order at hidden <= 1024) took the inference forward at 1024 from 4061 to 4082 GB/s.
// Backward 11 (H200, 2026-11-30, session 15): at hidden 1024 fewer resident blocks moved the bytes faster (4, 3, 2
// blocks of 128 threads per SM: 87.7, 89.2, 90.5% of copy with LEAN), one lane per warp copying the row statistics
// and w loaded after the first copies saved 2.5 us a call, a kernel without the (untaken) dropout code ~3 us,
// evict-first stores 0.7 us: 86% -> 91% of copy at 1024, 91 -> 95-97% at 2048 and 4096.
constexpr int kDefaultForwardVariant = 8, kDefaultBackwardVariant = 11;

struct DropoutArgs {
  bool enabled = false;
  uint64_t seed = 0, offset = 0;
  uint32_t threshold = 0;  // min(floor(p * 2^32), 2^32 - 1)
  float scale = 1.f;       // 1 / (1 - p) in fp32
};

struct ForwardArgs {
  void* y;                 // (rows, hidden)
  void* h;                 // (rows, hidden) or nullptr: not written (plain norm: h == x)
  float* mean;             // (rows,) or nullptr (RMSNorm, or no statistics)
  float* rstd;             // (rows,) or nullptr: no statistics (inference: nothing will run the backward)
  const void* x;
  const void* residual;    // nullable
  const void* weight;      // (hidden,) nullable
  const void* bias;        // (hidden,) nullable
  int64_t rows;
  int hidden;
  float eps;
  bool rms;
  DropoutArgs dropout;
  int variant = kDefaultForwardVariant;
};

struct BackwardArgs {
  void* dres;              // (rows, hidden): d loss / d h (norm path + incoming dh)
  void* dx;                // (rows, hidden) = dres · mask · scale, or nullptr when no dropout
  void* dw;                // (hidden,) or nullptr
  void* db;                // (hidden,) or nullptr
  float* partial;          // workspace: (2, backward_blocks, hidden) fp32
  const void* dy;
  const void* dh;          // nullable: gradient arriving at h from its other uses
  const void* h;           // the normalised input (x when h was not stored)
  const void* weight;      // nullable
  const float* mean;       // nullptr for RMSNorm
  const float* rstd;
  int64_t rows;
  int hidden;
  bool rms;
  DropoutArgs dropout;
  int variant = kDefaultBackwardVariant;
};

cudaError_t forward(const ForwardArgs& args, DType dtype, cudaStream_t stream);

// Blocks of the backward's persistent grid for these args (all but `partial` filled in); the workspace
// `partial` holds 2 * blocks * hidden floats. Fixed for given (args' shapes and variant, dtype, device),
// so the dw/db reduction order is deterministic.
int backward_blocks(const BackwardArgs& args, DType dtype);
cudaError_t backward(const BackwardArgs& args, DType dtype, cudaStream_t stream);

// The pipe variants (forward_pipe.cu, backward_pipe.cu). They return cudaErrorNotSupported, launching
// nothing, when their staging does not fit; the dispatchers above then run legacy.
namespace pipe {
cudaError_t forward(const ForwardArgs& args, DType dtype, cudaStream_t stream);
int backward_blocks(const BackwardArgs& args, DType dtype);  // 0: does not fit
cudaError_t backward(const BackwardArgs& args, DType dtype, int blocks, cudaStream_t stream);
}  // namespace pipe

}  // namespace tk_layernorm
