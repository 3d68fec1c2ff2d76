// Mamba-2 SSD forward (ssd.h) on the LCSF template (tk/lcsf.cuh) and wgmma.
//
// Tasks, inputs and the state's place as in ssd.cuh: each consumer warpgroup scans one head. With a_t = dt_t·A, Λ the
// inclusive cumulative sum of a inside the chunk and h (64 head dims × n) the state before the chunk, it computes
//   y = exp(Λ_t) ⊙ (C hᵀ) + (C Bᵀ ∘ L) X + D x,   L_ts = exp(Λ_t − Λ_s) dt_s for s ≤ t, else 0
//   h ← exp(Λ_end) h + (Xᵀ diag(exp(Λ_end − Λ_s) dt_s)) B
// all four products on wgmma: C Bᵀ and C hᵀ with both operands in shared memory (h as the bf16 copy the warpgroup
// publishes after each chunk), the masked scores and the decayed Xᵀ as register A operands against x and B in
// shared memory. The state never leaves registers; y leaves through a shared staging tile by TMA store (which drops
// the padded rows past l), in bf16 for bf16 x.
#include "ssd.cuh"

namespace tk_ssd {
namespace {

template <int NS, class OutT>
struct FwdGlobals {
  Stream<NS> in;
  tma_map<st<OutT, CHUNK, PT>> y;
  const float* A;   // or nullptr: simple GLA
  const float* D;   // or nullptr
  const float* h0;  // or nullptr
  float y_scale;
  float* h_final;
  Segments seg;  // a split sequence's segment states (Shape::segments > 1)
};

template <int NS, class OutT>
struct ssd_fwd : Scan<NS, false, false, 3, FwdGlobals<NS, OutT>> {
  using globals = FwdGlobals<NS, OutT>;
  using input_block = Chunk<NS, false>;
  using y_tile = st<OutT, CHUNK, PT>;
  struct scratch_block {
    state_tile<NS> h[HEADS];  // bf16 copy of each head's state before the current chunk
    y_tile y[HEADS];          // each head's output chunk on its way out
    Table table[HEADS][WARPGROUP_WARPS];
  };
  struct state {
    state_acc<NS> h;
  };

  __device__ static void compute(state& s, input_block& in, scratch_block& sc, const globals& g, const lcsf::task& t,
                                 int it) {
    const int wg = lcsf::consumer_id(), bar = 1 + wg;
    const Slot sl = slot_of(g.in.shape, t, wg);
    const int h = sl.h;
    if (h < 0) return;
    if (it == 0) {
      enter_state<NS, false>(s.h, g.h0, g.seg, g.in.shape, t, sl);
      publish_state(sc.h[wg], s.h, bar);
    }
    const x_tile& x = in.x[wg];

    rt_fl<BASE, CHUNK> cb;  // C_t · B_s: this warp's 16 tokens t by the chunk's 64 tokens s
    rt_fl<BASE, PT> y;      // C_t · h, then the output rows
    warpgroup::mm_ABt(cb, in.c, in.b);
    warpgroup::mm_ABt(y, in.c, sc.h[wg]);

    // while those run: the decays, and the state update's A operand
    const Decays d = chunk_decays(in.dt[wg], g.A, h);
    Table& tb = sc.table[wg][warpid_in_group()];
    fill_update(tb, d);
    const int row0 = BASE * warpid_in_group(), t0 = row0 + (laneid() >> 2);  // rows t0 and t0 + 8
    const float lt[2] = {tb.lam[t0], tb.lam[t0 + 8]};
    rt_bf<BASE, CHUNK> xw;
    weighted_transpose(xw, x, tb);

    warpgroup::mma_async_wait<1>(cb);  // (C hᵀ may still run)
    rt_bf<BASE, CHUNK> w;  // (C_t·B_s) exp(Λ_t − Λ_s) dt_s on and below the diagonal
    decay_mask<false, true>(w, cb, tb, lt, {1.f, 1.f}, row0);
    warpgroup::mma_async_wait<0>(y);
    mul_row(y, y, rows(__expf(lt[0]), __expf(lt[1])));
    mul(s.h, s.h, __expf(d.l_end));
    warpgroup::mma_AB(y, w, x);
    warpgroup::mma_AB(s.h, xw, in.b);
    warpgroup::mma_async_wait<0>(y, s.h, w, xw);
    if (g.y_scale != 1.f) mul(y, y, g.y_scale);

    if (g.D) {
      const float Dh = g.D[h];
      map_indexed(y, y, [&](int r, int c, float v) { return v + Dh * __bfloat162float(x(row0 + r, c)); });
    }
    // y out through the staging tile, once the previous chunk's store has read it; h's copy for the next chunk
    const bool leader = threadIdx.x % WARPGROUP_THREADS == 0;
    if (leader) tma::store_read_wait<0>();
    warpgroup::sync(bar);
    if constexpr (std::is_same_v<OutT, bf16>) {
      rt_bf<BASE, PT> yb;
      copy(yb, y);
      warpgroup::store(sc.y[wg], yb);
    } else {
      warpgroup::store(sc.y[wg], y);
    }
    publish_state(sc.h[wg], s.h, bar);  // (its fence and barrier also order the staging tile before the store)
    if (leader) {
      tma::store_async(g.y, sc.y[wg], {t.coord[0], 0, ssd_fwd::chunk_of(g, t, it), sl.tile});
      tma::store_commit();
    }
  }

  __device__ static void store(state& s, scratch_block&, const globals& g, const lcsf::task& t) {
    const Slot sl = slot_of(g.in.shape, t, lcsf::consumer_id());
    if (sl.h >= 0 && t.coord[3] == g.in.shape.segments - 1)  // the sequence's last segment: the final state
      write_state<NS>(g.h_final, s.h, state_base<NS>(g.in.shape, t, sl));
  }

  __device__ static void finish(scratch_block&, const globals&) {
    if (threadIdx.x % WARPGROUP_THREADS == 0) tma::store_wait<0>();
  }
};

template <int NS, class OutT>
const char* run(const Args& a, cudaStream_t stream) {
  using K = ssd_fwd<NS, OutT>;
  typename K::globals g{};
  const Shape sh = shape_of(a.b, a.l, a.l_pad, a.nh, a.ng, a.p, HEADS, a.segments);
  if (sh.segments != (sh.chunks + sh.seg_chunks - 1) / sh.seg_chunks) return "segments must split the chunks evenly";
  if (const char* e = make_stream(g.in, a.x, nullptr, a.B, a.C, a.dt, sh)) return e;
  if (const char* e = make_tma_map(g.y, gl<OutT>(static_cast<OutT*>(a.y), a.b, 1, a.l, a.nh * a.p))) return e;
  g.A = a.A, g.D = a.D, g.h0 = a.h0, g.y_scale = a.y_scale, g.h_final = a.h_final, g.seg = {a.seg_states, a.seg_decay};
  if (tasks_of(sh) > 0x7fffffff) return "too many (batch, head, head-dim tile, segment) tasks";
  cudaError_t e = cudaSuccess;
  if (sh.segments > 1) e = launch_segment_states<NS, false>(g.in, a.A, g.seg, stream);
  if (e == cudaSuccess) e = lcsf::launch<K>(g, int(tasks_of(sh)), stream);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

int scan_segments(int b, int l, int nh, int ng, int p) {
  if (b <= 0 || l <= 0 || nh <= 0 || ng <= 0 || nh % ng != 0 || p <= 0 || p % P_TILE != 0) return 1;
  const Shape sh = shape_of(b, l, (l + CHUNK - 1) / CHUNK * CHUNK, nh, ng, p, HEADS);
  return segments_for(tasks_of(sh, 1), sh.chunks, grid::sm_count());
}

const char* launch(const Args& a, cudaStream_t stream) {
  if (a.p <= 0 || a.p % P_TILE != 0) return "the head dim p must be a positive multiple of 64";
  if (a.ng <= 0 || a.nh % a.ng != 0) return "nh must be a multiple of ng";
  if (a.b <= 0 || a.nh <= 0) return nullptr;  // nothing to compute
  if (a.l <= 0) return "l must be >= 1 (the binding handles empty sequences)";
  if (a.l_pad < a.l || a.l_pad % CHUNK != 0) return "dt must be padded to whole chunks of 64";
  if (a.segments < 1 || (a.segments > 1 && (!a.seg_states || !a.seg_decay)))
    return "a split sequence (segments > 1) needs the segment scratch";
  switch (a.n * 2 + a.y_bf16) {
    case 16 * 2 + 1: return run<16, bf16>(a, stream);
    case 16 * 2: return run<16, float>(a, stream);
    case 32 * 2 + 1: return run<32, bf16>(a, stream);
    case 32 * 2: return run<32, float>(a, stream);
    case 64 * 2 + 1: return run<64, bf16>(a, stream);
    case 64 * 2: return run<64, float>(a, stream);
    case 128 * 2 + 1: return run<128, bf16>(a, stream);
    case 128 * 2: return run<128, float>(a, stream);
    default: return "the state size n must be 16, 32, 64 or 128";
  }
}

}  // namespace tk_ssd
