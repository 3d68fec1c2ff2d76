// What the SSD forward (ssd.cu) and backward (ssd_backward.cu) share. All three kernels are chunked scans on the
// LCSF template (tk/lcsf.cuh) with the same tasks and inputs:
//  - a group's slots are its (head, 64-head-dim tile) pairs, head-major; a task is (batch, group, HEADS of the group's
//    slots), consumer warpgroup w scanning slot HEADS·set + w (none in a group's short last set), one 64-token chunk
//    per iteration. With one head per group (simple GLA) the slots are that head's head-dim tiles;
//  - the producer streams each chunk's B and C once for the task's heads (they share the group) and each head's
//    x, dt (and for the backward dy) by TMA; tokens past l read as zeros and dt is zero-padded to whole chunks (no
//    decay, no input);
//  - a warpgroup's state (h or ∂L/∂h, 64 head dims × n) is its fp32 wgmma accumulator: warp w holds head dims
//    16w..16w+15, so a state update is one wgmma with the decayed, transposed chunk rows as register A operand;
//  - a scan may split each sequence into segments of chunks (when there are too few tasks for the SMs): a first
//    pass (ssd_segment_states, below) gives each segment's state from zero and its total decay, and a segment's
//    task starts from the scan's initial state carried across the segments before it (enter_state).
// Here: the tasks and the input loads, the chunk's decays (Λ, the inclusive cumulative sum of dt·A) and causal
// masks, and the state's moves (from and to (b, nh, p, n) fp32 tensors, its bf16 copy in shared memory).
#pragma once
#include <tk/tk.cuh>

#include "ssd.h"

namespace tk_ssd {
namespace {

using namespace tk;

constexpr int CHUNK = 64, PT = P_TILE;  // tokens per chunk; head dims per task (the state's 64 rows, wgmma's M)
constexpr int HEADS = 2;                // heads per task: one per consumer warpgroup

using x_tile = st<bf16, CHUNK, PT>;  // a chunk of x or dy (tokens × head dims)
template <int NS> using bc_tile = st<bf16, CHUNK, NS>;  // a chunk of B or C (tokens × state dims)
template <int NS> using state_tile = st<bf16, PT, NS>;  // a state's bf16 copy (head dims × state dims)
template <int NS> using state_acc = rt_fl<BASE, NS>;    // a warp's 16 head dims of a state

struct Shape {
  int batch, nh, ng, p, l, l_pad, chunks, slot_sets, ptiles;  // slot_sets: tasks per group and segment
  int segments, seg_chunks;  // segments per sequence (1: no split), chunks per segment (the last may have fewer)
};
inline Shape shape_of(int b, int l, int l_pad, int nh, int ng, int p, int heads, int segments = 1) {
  const int chunks = (l + CHUNK - 1) / CHUNK, seg_chunks = (chunks + segments - 1) / segments;
  return {b, nh, ng, p, l, l_pad, chunks, (nh / ng * (p / PT) + heads - 1) / heads, p / PT, segments, seg_chunks};
}
// Tasks of a scan over `segments` segments of each sequence.
inline long long tasks_of(const Shape& s, int segments) {
  return (long long)s.batch * s.ng * s.slot_sets * segments;
}
inline long long tasks_of(const Shape& s) { return tasks_of(s, s.segments); }

// Segments per sequence for a scan of `tasks` tasks (one per SM at a time) of `chunks` chunks each on `sms` SMs:
// the count with the fewest estimated chunk-times, waves × segment length, plus the segment-states pass over all
// segments but one at SEGMENT_PASS_COST of a scan's chunk (an estimate: the state update alone). At most
// chunks / MIN_SEGMENT_CHUNKS segments (the last may be shorter than the others) and MAX_SEGMENTS.
constexpr int MIN_SEGMENT_CHUNKS = 4, MAX_SEGMENTS = 16;
constexpr double SEGMENT_PASS_COST = 0.4;
inline int segments_for(long long tasks, int chunks, int sms) {
  auto waves = [&](long long n) { return double((n + sms - 1) / sms); };
  int best = 1;
  double best_cost = waves(tasks) * chunks;
  for (int s = 2; s <= MAX_SEGMENTS && chunks / s >= MIN_SEGMENT_CHUNKS; ++s) {
    const int len = (chunks + s - 1) / s;
    if ((chunks + len - 1) / len != s) continue;  // the same segments as a smaller count
    const double cost = waves(tasks * s) * len + SEGMENT_PASS_COST * waves(tasks * (s - 1)) * len;
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// What every kernel streams: x (and dy), B, C by TMA, dt (b, nh, l_pad) by bulk copy.
template <int NS>
struct Stream {
  tma_map<x_tile> x, dy;  // dy: the backward only
  tma_map<bc_tile<NS>> b, c;
  const float* dt;
  Shape shape;
};
template <int NS>
const char* make_stream(Stream<NS>& s, const void* x, const void* dy, const void* B, const void* C, const float* dt,
                        const Shape& sh) {
  auto view = [&](const void* p, int cols) {
    return gl<bf16>(static_cast<bf16*>(const_cast<void*>(p)), sh.batch, 1, sh.l, cols);
  };
  if (const char* e = make_tma_map(s.x, view(x, sh.nh * sh.p))) return e;
  if (dy)
    if (const char* e = make_tma_map(s.dy, view(dy, sh.nh * sh.p))) return e;
  if (const char* e = make_tma_map(s.b, view(B, sh.ng * NS))) return e;
  if (const char* e = make_tma_map(s.c, view(C, sh.ng * NS))) return e;
  s.dt = dt, s.shape = sh;
  return nullptr;
}

// One ring stage: the chunk's B and C, and each head's x, dt and (DY) dy.
template <bool DY>
struct DyTiles {
  x_tile dy[HEADS];
};
template <>
struct DyTiles<false> {};
template <int NS, bool DY>
struct Chunk : DyTiles<DY> {
  bc_tile<NS> b, c;
  x_tile x[HEADS];
  float dt[HEADS][CHUNK];
};

// task id -> (batch, group, set of HEADS slots in the group, segment) for a scan over `segments` segments from
// segment `first` on; the segment's chunks are its iterations.
__device__ __forceinline__ bool setup_task(lcsf::task& t, const Shape& s, int segments, int first) {
  const int per_batch = s.ng * s.slot_sets, per_segment = s.batch * per_batch;
  if (t.id >= per_segment * segments) return false;
  const int r = t.id % per_segment % per_batch;
  t.coord[0] = t.id % per_segment / per_batch, t.coord[1] = r / s.slot_sets, t.coord[2] = r % s.slot_sets;
  t.coord[3] = first + t.id / per_segment;
  t.iters = min(s.seg_chunks, s.chunks - t.coord[3] * s.seg_chunks);
  return true;
}
// Consumer w's slot in task t: its head (-1: none, the group's last set may be short), the head's 64-head-dim tile,
// and that tile's column tile in the (b, l, nh·p) views of x, dy and y.
struct Slot {
  int h, pt, tile;
};
__device__ __forceinline__ Slot slot_of(const Shape& s, const lcsf::task& t, int w) {
  const int per_group = s.nh / s.ng, j = HEADS * t.coord[2] + w;
  if (j >= per_group * s.ptiles) return {-1, 0, 0};
  const int tile = t.coord[1] * per_group * s.ptiles + j;
  return {tile / s.ptiles, tile % s.ptiles, tile};
}

// Which of a chunk's tiles a kernel reads (dt always).
enum Loads : int { LOAD_B = 1, LOAD_C = 2, LOAD_X = 4, LOAD_DY = 8 };

// Chunk `chunk` of task t into a stage (one producer thread): the tiles in LOADS.
template <int LOADS, int NS, bool DY>
__device__ __forceinline__ void load_chunk(Chunk<NS, DY>& in, semaphore& arrived, const Stream<NS>& g,
                                           const lcsf::task& t, int chunk) {
  static_assert(DY || !(LOADS & LOAD_DY), "dy needs a stage with a dy tile");
  int heads = 0;
#pragma unroll
  for (int w = 0; w < HEADS; ++w) heads += slot_of(g.shape, t, w).h >= 0;
  constexpr int shared = (LOADS & LOAD_B ? 1 : 0) + (LOADS & LOAD_C ? 1 : 0);
  constexpr int per_head = (LOADS & LOAD_X ? 1 : 0) + (LOADS & LOAD_DY ? 1 : 0);
  expect_bytes(arrived, shared * bc_tile<NS>::bytes + heads * (per_head * x_tile::bytes + CHUNK * int(sizeof(float))));
  const int b = t.coord[0];
  if constexpr (LOADS & LOAD_B) tma::load_async(in.b, g.b, arrived, {b, 0, chunk, t.coord[1]});
  if constexpr (LOADS & LOAD_C) tma::load_async(in.c, g.c, arrived, {b, 0, chunk, t.coord[1]});
#pragma unroll
  for (int w = 0; w < HEADS; ++w) {
    const Slot sl = slot_of(g.shape, t, w);
    if (sl.h < 0) continue;
    const coord at{b, 0, chunk, sl.tile};
    if constexpr (LOADS & LOAD_X) tma::load_async(in.x[w], g.x, arrived, at);
    if constexpr (LOADS & LOAD_DY) tma::load_async(in.dy[w], g.dy, arrived, at);
    tma::load_bytes_async(in.dt[w], g.dt + (int64_t(b) * g.shape.nh + sl.h) * g.shape.l_pad + chunk * CHUNK,
                          CHUNK * sizeof(float), arrived);
  }
}

// The LCSF pieces every SSD kernel shares: its warpgroups and ring, the tasks, and the chunk loads (REVERSE: a
// segment's last chunk first). G is the kernel's globals, with the streamed inputs as `in`. PASS: a segment-states
// pass, which walks every segment but the scan's last (the sequence's last forward, its first in REVERSE) and reads
// only the state update's operands (x and B forward, dy and C in REVERSE).
template <int NS, bool DY, bool REVERSE, int STAGES, class G, bool PASS = false>
struct Scan {
  static constexpr int CONSUMER_WARPGROUPS = HEADS, INPUT_PIPE_STAGES = STAGES;
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static constexpr int LOADS = !PASS ? LOAD_B | LOAD_C | LOAD_X | (DY ? LOAD_DY : 0)
                                     : REVERSE ? LOAD_C | LOAD_DY : LOAD_B | LOAD_X;
  using globals = G;
  using input_block = Chunk<NS, DY>;
  // the chunk that iteration it of task t works on
  __device__ static int chunk_of(const G& g, const lcsf::task& t, int it) {
    const int first = t.coord[3] * g.in.shape.seg_chunks;
    return REVERSE ? first + t.iters - 1 - it : first + it;
  }
  __device__ static bool setup(lcsf::task& t, const G& g) {
    const Shape& s = g.in.shape;
    return PASS ? setup_task(t, s, s.segments - 1, REVERSE ? 1 : 0) : setup_task(t, s, s.segments, 0);
  }
  __device__ static void load(input_block& in, semaphore& arrived, const G& g, const lcsf::task& t, int it) {
    load_chunk<LOADS>(in, arrived, g.in, t, chunk_of(g, t, it));
  }
};

// Λ inside a chunk (the inclusive cumulative sum of a = dt·A), two tokens per lane: lane holds tokens 2·lane and
// 2·lane + 1 (Λ in l0, l1; the inputs' scale dt in dt0, dt1); every lane holds Λ_end. Every warp computes it (a
// shuffle scan).
struct Decays {
  float dt0, dt1, l0, l1, l_end;
};

// From the chunk's 64 dt values in shared memory and head h's A. Without A (simple GLA, ssd.h) dt is the log decay
// a itself and the inputs' scale is 1.
__device__ __forceinline__ Decays chunk_decays(const float* dt, const float* A, int h) {
  const int lane = laneid();
  const float Ah = A ? A[h] : 1.f;
  Decays d;
  d.dt0 = dt[2 * lane], d.dt1 = dt[2 * lane + 1];
  const float a0 = d.dt0 * Ah, a1 = d.dt1 * Ah;
  if (!A) d.dt0 = d.dt1 = 1.f;
  float run = a0 + a1;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, run, off);
    if (lane >= off) run += up;
  }
  d.l1 = run, d.l0 = run - a1, d.l_end = __shfl_sync(0xffffffffu, run, 31);
  return d;
}

// A chunk's per-token values for one warp's lookups by column: Λ, dt and the state update's per-token weight, in
// shared memory. Each warp keeps its own copy, written and read only by itself (__syncwarp orders them); a register
// tile's element pair (columns c, c + 1, c even) reads each as one float2, where the lanes' registers would take a
// shuffle per element.
struct Table {
  float lam[CHUNK], dt[CHUNK], w[CHUNK];
};
// Fills the table from the chunk's decays and the weights of the lane's tokens 2·lane and 2·lane + 1.
__device__ __forceinline__ void fill(Table& tb, const Decays& d, float w0, float w1) {
  __syncwarp();  // the previous chunk's reads are done
  const int i = 2 * laneid();
  *reinterpret_cast<float2*>(&tb.lam[i]) = make_float2(d.l0, d.l1);
  *reinterpret_cast<float2*>(&tb.dt[i]) = make_float2(d.dt0, d.dt1);
  *reinterpret_cast<float2*>(&tb.w[i]) = make_float2(w0, w1);
  __syncwarp();
}
// The weights of the forward's state update (and kernel A's), exp(Λ_end − Λ_s) dt_s, and of g's, exp(Λ_t).
__device__ __forceinline__ void fill_update(Table& tb, const Decays& d) {
  fill(tb, d, __expf(d.l_end - d.l0) * d.dt0, __expf(d.l_end - d.l1) * d.dt1);
}
__device__ __forceinline__ void fill_reverse(Table& tb, const Decays& d) { fill(tb, d, __expf(d.l0), __expf(d.l1)); }
__device__ __forceinline__ float2 pair(const float* v, int c) { return *reinterpret_cast<const float2*>(v + c); }
// The first of this lane's two columns in register pair (base tile j, register k) of a row-layout tile.
__device__ __forceinline__ int pair_col(int j, int k) { return BASE * j + base_col<row_layout>(k, 0); }

// dst = scores ∘ the causal decay between a warp's 16 rows (row0 + r; their Λ in lrow and a factor in rw, rows r and
// r + 8) and the chunk's 64 tokens as columns: lower (col ≤ row) exp(Λ_row − Λ_col), upper (col ≥ row)
// exp(Λ_col − Λ_row), zero elsewhere; times dt_col with COL_DT, and times the row's factor.
template <bool UPPER, bool COL_DT>
__device__ __forceinline__ void decay_mask(rt_bf<BASE, CHUNK>& dst, const rt_fl<BASE, CHUNK>& scores, const Table& tb,
                                           const float (&lrow)[2], const float (&rw)[2], int row0) {
  const int r0 = row0 + (laneid() >> 2);
#pragma unroll
  for (int j = 0; j < CHUNK / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = pair_col(j, k), t = r0 + 8 * (k & 1);
      const float2 lc = pair(tb.lam, c), dc = COL_DT ? pair(tb.dt, c) : make_float2(1.f, 1.f);
      const float2 v = scores.tiles[0][j].data[k];
      const float l = lrow[k & 1], f = rw[k & 1];
      const bool on0 = UPPER ? c >= t : c <= t, on1 = UPPER ? c + 1 >= t : c + 1 <= t;
      const float e0 = __expf(UPPER ? lc.x - l : l - lc.x), e1 = __expf(UPPER ? lc.y - l : l - lc.y);
      dst.tiles[0][j].data[k] = __floats2bfloat162_rn(on0 ? v.x * e0 * dc.x * f : 0.f, on1 ? v.y * e1 * dc.y * f : 0.f);
    }
}

// A state update's A operand: this warp's 16 head dims of a chunk tile (tokens × head dims) transposed, token s
// scaled by the table's weight.
__device__ __forceinline__ void weighted_transpose(rt_bf<BASE, CHUNK>& dst, const x_tile& src, const Table& tb) {
  rt_bf<CHUNK, BASE, col_layout> t;
  load(t, src, 0, BASE * warpid_in_group());
  const rt_bf<BASE, CHUNK>& tt = transposed(t);
#pragma unroll
  for (int j = 0; j < CHUNK / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 w = pair(tb.w, pair_col(j, k)), v = __bfloat1622float2(tt.tiles[0][j].data[k]);
      dst.tiles[0][j].data[k] = __floats2bfloat162_rn(v.x * w.x, v.y * w.y);
    }
}

// Per-row factors of a warp's 16-row accumulator (tk's row vector, for mul_row): this lane's rows r and r + 8.
using row_factors = rv<float, BASE, vec_pair8>;
__device__ __forceinline__ row_factors rows(float r, float r8) {
  row_factors v;
  v.data[0][0] = r, v.data[0][1] = r8;
  return v;
}

// (b, h, p0 + 16·warp, 0) of a (b, nh, p, n) state tensor: where this warp's rows of slot sl's state start.
template <int NS>
__device__ __forceinline__ int64_t state_base(const Shape& s, const lcsf::task& t, const Slot& sl) {
  return ((int64_t(t.coord[0]) * s.nh + sl.h) * s.p + sl.pt * PT + BASE * warpid_in_group()) * NS;
}
// Calls f(register pair, its element offset from the rows' start) for each of a warp's state registers, as the rows
// lie in a (…, p, n) fp32 tensor.
template <int NS, class F>
__device__ __forceinline__ void for_state_pairs(state_acc<NS>& S, F&& f) {
#pragma unroll
  for (int j = 0; j < NS / BASE; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      f(S.tiles[0][j].data[k], base_row<row_layout>(k, 0) * NS + BASE * j + base_col<row_layout>(k, 0));
}
// A warp's state rows from a (b, nh, p, n) fp32 tensor (zero without one), added from one, and back.
template <int NS>
__device__ __forceinline__ void read_state(state_acc<NS>& S, const float* src, int64_t base) {
  for_state_pairs(S, [&](float2& v, int at) {
    v = src ? *reinterpret_cast<const float2*>(src + base + at) : make_float2(0.f, 0.f);
  });
}
template <int NS>
__device__ __forceinline__ void add_state(state_acc<NS>& S, const float* src, int64_t base) {
  for_state_pairs(S, [&](float2& v, int at) {
    const float2 a = *reinterpret_cast<const float2*>(src + base + at);
    v.x += a.x, v.y += a.y;
  });
}
template <int NS>
__device__ __forceinline__ void write_state(float* dst, state_acc<NS>& S, int64_t base) {
  for_state_pairs(S, [&](float2& v, int at) { *reinterpret_cast<float2*>(dst + base + at) = v; });
}
// The split scans' segment results: each segment's state from zero ((b, nh, segments, p, n) fp32) and total decay
// Σ dt·A ((b, nh, segments) fp32), from the segment-states pass.
struct Segments {
  float* states;
  float* decay;
};
// (b, h, segment j, p0 + 16·warp, 0) of the segment states: where this warp's rows of slot sl start.
template <int NS>
__device__ __forceinline__ int64_t segment_base(const Shape& s, const lcsf::task& t, const Slot& sl, int j) {
  return (((int64_t(t.coord[0]) * s.nh + sl.h) * s.segments + j) * s.p + sl.pt * PT + BASE * warpid_in_group()) * NS;
}
// The state entering task t's segment (REVERSE: the scan runs last segment first): the scan's initial state `init`
// ((b, nh, p, n) fp32 or null: zero) carried across the segments the scan passes before it, S ← exp(decay_j) S +
// state_j, from the first on.
template <int NS, bool REVERSE>
__device__ __forceinline__ void enter_state(state_acc<NS>& S, const float* init, const Segments& seg, const Shape& s,
                                            const lcsf::task& t, const Slot& sl) {
  read_state<NS>(S, init, state_base<NS>(s, t, sl));
  const int k = t.coord[3], before = REVERSE ? s.segments - 1 - k : k;
  for (int i = 0; i < before; ++i) {
    const int j = REVERSE ? s.segments - 1 - i : i;
    mul(S, S, __expf(seg.decay[(int64_t(t.coord[0]) * s.nh + sl.h) * s.segments + j]));
    add_state<NS>(S, seg.states, segment_base<NS>(s, t, sl, j));
  }
}

// The state's bf16 copy for the next wgmmas that read it: the caller's warpgroup must be done reading the old one;
// ends with the fence and the warpgroup barrier `bar`.
template <int NS>
__device__ __forceinline__ void publish_state(state_tile<NS>& dst, const state_acc<NS>& S, int bar) {
  rt_bf<BASE, NS> copy_bf;
  copy(copy_bf, S);
  warpgroup::store(dst, copy_bf);
  fence_async_shared();
  warpgroup::sync(bar);
}


// The segment-states pass of a split scan (Scan's PASS): each segment's state from zero and its total decay Σ dt·A
// (Segments) for the segments a scan's tasks enter after. Forward, the state h: h ← exp(Λ_end) h + (Xᵀ diag(exp(Λ_end −
// Λ_s) dt_s)) B; REVERSE, ∂L/∂h as the backward's kernel B carries it (last chunk first): g ← exp(Λ_end) g +
// (dyᵀ diag(exp(Λ_t))) C.
template <int NS>
struct SegmentGlobals {
  Stream<NS> in;
  const float* A;
  Segments seg;
};

template <int NS, bool REVERSE>
struct ssd_segment_states : Scan<NS, REVERSE, REVERSE, 3, SegmentGlobals<NS>, true> {
  using globals = SegmentGlobals<NS>;
  using input_block = Chunk<NS, REVERSE>;
  struct scratch_block {
    Table table[HEADS][WARPGROUP_WARPS];
  };
  struct state {
    state_acc<NS> h;
    float decay;  // Σ Λ_end over the chunks so far
  };

  __device__ static void compute(state& s, input_block& in, scratch_block& sc, const globals& g, const lcsf::task& t,
                                 int it) {
    const int wg = lcsf::consumer_id(), h = slot_of(g.in.shape, t, wg).h;
    if (h < 0) return;
    if (it == 0) zero(s.h), s.decay = 0.f;
    const Decays d = chunk_decays(in.dt[wg], g.A, h);
    Table& tb = sc.table[wg][warpid_in_group()];
    if constexpr (REVERSE) fill_reverse(tb, d);
    else fill_update(tb, d);
    rt_bf<BASE, CHUNK> w;  // the update's A operand
    if constexpr (REVERSE) weighted_transpose(w, in.dy[wg], tb);
    else weighted_transpose(w, in.x[wg], tb);
    mul(s.h, s.h, __expf(d.l_end));
    warpgroup::mma_AB(s.h, w, REVERSE ? in.c : in.b);
    warpgroup::mma_async_wait<0>(s.h, w);
    s.decay += d.l_end;
  }

  __device__ static void store(state& s, scratch_block&, const globals& g, const lcsf::task& t) {
    const Shape& sh = g.in.shape;
    const Slot sl = slot_of(sh, t, lcsf::consumer_id());
    if (sl.h < 0) return;
    write_state<NS>(g.seg.states, s.h, segment_base<NS>(sh, t, sl, t.coord[3]));
    if (sl.pt == 0 && threadIdx.x % WARPGROUP_THREADS == 0)
      g.seg.decay[(int64_t(t.coord[0]) * sh.nh + sl.h) * sh.segments + t.coord[3]] = s.decay;
  }
};

template <int NS, bool REVERSE>
cudaError_t launch_segment_states(const Stream<NS>& in, const float* A, const Segments& seg, cudaStream_t stream) {
  const SegmentGlobals<NS> g{in, A, seg};
  return lcsf::launch<ssd_segment_states<NS, REVERSE>>(g, int(tasks_of(in.shape, in.shape.segments - 1)), stream);
}

}  // namespace
}  // namespace tk_ssd
