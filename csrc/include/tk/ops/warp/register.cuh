// Warp-scope register ops on tiles and vectors: fills, maps, broadcasts, reductions,
// conversions and layout swaps. Destination first. Arithmetic runs in fp32 and is rounded to
// the destination type, so bf16/fp16 tiles behave like PyTorch's upcast-compute-downcast.
#pragma once
#include <cfloat>
#include "../../types/rv.cuh"

namespace tk {

namespace op {
struct copy { TK_DEVICE static float apply(float x) { return x; } };
struct exp { TK_DEVICE static float apply(float x) { return __expf(x); } };
struct exp2 { TK_DEVICE static float apply(float x) { return exp2f(x); } };
struct log { TK_DEVICE static float apply(float x) { return __logf(x); } };
struct log2 { TK_DEVICE static float apply(float x) { return log2f(x); } };
struct abs { TK_DEVICE static float apply(float x) { return fabsf(x); } };
struct neg { TK_DEVICE static float apply(float x) { return -x; } };
struct relu { TK_DEVICE static float apply(float x) { return fmaxf(x, 0.f); } };
struct sqrt { TK_DEVICE static float apply(float x) { return sqrtf(x); } };
struct rsqrt { TK_DEVICE static float apply(float x) { return rsqrtf(x); } };
struct add { static constexpr float identity = 0.f; TK_DEVICE static float apply(float a, float b) { return a + b; } };
struct sub { TK_DEVICE static float apply(float a, float b) { return a - b; } };
struct mul { static constexpr float identity = 1.f; TK_DEVICE static float apply(float a, float b) { return a * b; } };
struct div { TK_DEVICE static float apply(float a, float b) { return __fdividef(a, b); } };
struct max { static constexpr float identity = -INFINITY; TK_DEVICE static float apply(float a, float b) { return fmaxf(a, b); } };
struct min { static constexpr float identity = INFINITY; TK_DEVICE static float apply(float a, float b) { return fminf(a, b); } };
}  // namespace op

namespace detail {
template <class A, class B> constexpr bool same_shape =
    A::rows == B::rows && A::cols == B::cols && std::is_same_v<typename A::layout, typename B::layout>;
template <class T> TK_DEVICE float f(T x) { return convert<float>(x); }
template <register_tile S> TK_DEVICE float get(const S& s, int i, int w, int k, int j) {
    return j ? f(s.tiles[i][w].data[k].y) : f(s.tiles[i][w].data[k].x);
}
// Which slot of a row / column vector element (k, j) of layout L belongs to.
template <class L> TK_DEVICE constexpr int row_slot(int k, int j) {
    if constexpr (std::is_same_v<L, row_layout>) return k & 1;
    else return (k >> 1) * 2 + j;
}
template <class L> TK_DEVICE constexpr int col_slot(int k, int j) {
    if constexpr (std::is_same_v<L, row_layout>) return (k >> 1) * 2 + j;
    else return k & 1;
}
}  // namespace detail

// ---- tiles: fills and maps ----
template <register_tile D> TK_DEVICE void fill(D& dst, float v) { detail::for_each(dst, [&](int, int, int, int) { return v; }); }
template <register_tile D> TK_DEVICE void zero(D& dst) { fill(dst, 0.f); }
template <register_tile D> TK_DEVICE void one(D& dst) { fill(dst, 1.f); }
template <register_tile D> TK_DEVICE void neg_infty(D& dst) { fill(dst, -INFINITY); }
template <register_tile D> TK_DEVICE void pos_infty(D& dst) { fill(dst, INFINITY); }

template <class F, register_tile D, register_tile S> TK_DEVICE void unary_map(D& dst, const S& src) {
    static_assert(detail::same_shape<D, S>, "unary_map: shapes or layouts differ");
    detail::for_each(dst, [&](int i, int w, int k, int j) { return F::apply(detail::get(src, i, w, k, j)); });
}
template <class F, register_tile D, register_tile A, register_tile B> TK_DEVICE void bin_map(D& dst, const A& a, const B& b) {
    static_assert(detail::same_shape<D, A> && detail::same_shape<D, B>, "bin_map: shapes or layouts differ");
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        return F::apply(detail::get(a, i, w, k, j), detail::get(b, i, w, k, j));
    });
}
template <class F, register_tile D, register_tile A> TK_DEVICE void bin_map(D& dst, const A& a, float b) {
    static_assert(detail::same_shape<D, A>, "bin_map: shapes or layouts differ");
    detail::for_each(dst, [&](int i, int w, int k, int j) { return F::apply(detail::get(a, i, w, k, j), b); });
}

// ---- tiles: row / column broadcasts. *_row: v holds one value per row; *_col: per column ----
template <class F, register_tile D, register_tile S, register_vector V> TK_DEVICE void row_map(D& dst, const S& src, const V& v) {
    static_assert(detail::same_shape<D, S> && std::is_same_v<V, row_vec<S, typename V::T>>, "row_map: v must be row_vec<tile>");
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        return F::apply(detail::get(src, i, w, k, j), detail::f(v.data[i][detail::row_slot<typename S::layout>(k, j)]));
    });
}
template <class F, register_tile D, register_tile S, register_vector V> TK_DEVICE void col_map(D& dst, const S& src, const V& v) {
    static_assert(detail::same_shape<D, S> && std::is_same_v<V, col_vec<S, typename V::T>>, "col_map: v must be col_vec<tile>");
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        return F::apply(detail::get(src, i, w, k, j), detail::f(v.data[w][detail::col_slot<typename S::layout>(k, j)]));
    });
}
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void add_row(D& d, const S& s, const V& v) { row_map<op::add>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void sub_row(D& d, const S& s, const V& v) { row_map<op::sub>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void mul_row(D& d, const S& s, const V& v) { row_map<op::mul>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void div_row(D& d, const S& s, const V& v) { row_map<op::div>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void max_row(D& d, const S& s, const V& v) { row_map<op::max>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void add_col(D& d, const S& s, const V& v) { col_map<op::add>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void sub_col(D& d, const S& s, const V& v) { col_map<op::sub>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void mul_col(D& d, const S& s, const V& v) { col_map<op::mul>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void div_col(D& d, const S& s, const V& v) { col_map<op::div>(d, s, v); }
template <register_tile D, register_tile S, register_vector V> TK_DEVICE void max_col(D& d, const S& s, const V& v) { col_map<op::max>(d, s, v); }
// dst[r][c] = v[r]  /  dst[r][c] = v[c]
template <register_tile D, register_vector V> TK_DEVICE void broadcast_row(D& dst, const V& v) {
    detail::for_each(dst, [&](int i, int, int k, int j) { return detail::f(v.data[i][detail::row_slot<typename D::layout>(k, j)]); });
}
template <register_tile D, register_vector V> TK_DEVICE void broadcast_col(D& dst, const V& v) {
    detail::for_each(dst, [&](int, int w, int k, int j) { return detail::f(v.data[w][detail::col_slot<typename D::layout>(k, j)]); });
}

// ---- tiles: reductions. row_*: one value per row (over columns); col_*: per column ----
// The 3-argument forms fold in an accumulator: dst = F(reduce(src), acc) (online softmax's running max/sum).
template <class F, bool Rows, register_vector V, register_tile S>
TK_DEVICE void reduce(V& dst, const S& src, const V* acc) {
    using L = typename S::layout;
    constexpr int outer = Rows ? S::height : S::width, inner = Rows ? S::width : S::height;
    static_assert(V::length == (Rows ? S::rows : S::cols) &&
                  std::is_same_v<typename V::layout, typename std::conditional_t<Rows, row_vec<S>, col_vec<S>>::layout>, "reduce: wrong vector type");
#pragma unroll
    for (int o = 0; o < outer; ++o) {
        float r[V::per_base];
#pragma unroll
        for (int s = 0; s < V::per_base; ++s) r[s] = F::identity;
#pragma unroll
        for (int n = 0; n < inner; ++n)
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int slot = Rows ? detail::row_slot<L>(k, j) : detail::col_slot<L>(k, j);
                    r[slot] = F::apply(r[slot], Rows ? detail::get(src, o, n, k, j) : detail::get(src, n, o, k, j));
                }
#pragma unroll
        for (int s = 0; s < V::per_base; ++s) {
            // pair8 slots are shared by the 4 lanes of a quad (xor 1, 2); quad slots by lanes 4 apart.
            if constexpr (std::is_same_v<typename V::layout, vec_pair8>) {
                r[s] = F::apply(r[s], __shfl_xor_sync(0xffffffff, r[s], 1));
                r[s] = F::apply(r[s], __shfl_xor_sync(0xffffffff, r[s], 2));
            } else {
                r[s] = F::apply(r[s], __shfl_xor_sync(0xffffffff, r[s], 4));
                r[s] = F::apply(r[s], __shfl_xor_sync(0xffffffff, r[s], 8));
                r[s] = F::apply(r[s], __shfl_xor_sync(0xffffffff, r[s], 16));
            }
            if (acc) r[s] = F::apply(r[s], detail::f(acc->data[o][s]));
            dst.data[o][s] = convert<typename V::T>(r[s]);
        }
    }
}
template <register_vector V, register_tile S> TK_DEVICE void row_max(V& d, const S& s) { reduce<op::max, true>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void row_min(V& d, const S& s) { reduce<op::min, true>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void row_sum(V& d, const S& s) { reduce<op::add, true>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void row_prod(V& d, const S& s) { reduce<op::mul, true>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void col_max(V& d, const S& s) { reduce<op::max, false>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void col_min(V& d, const S& s) { reduce<op::min, false>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void col_sum(V& d, const S& s) { reduce<op::add, false>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void col_prod(V& d, const S& s) { reduce<op::mul, false>(d, s, (const V*)nullptr); }
template <register_vector V, register_tile S> TK_DEVICE void row_max(V& d, const S& s, const V& acc) { V t = acc; reduce<op::max, true>(d, s, &t); }
template <register_vector V, register_tile S> TK_DEVICE void row_min(V& d, const S& s, const V& acc) { V t = acc; reduce<op::min, true>(d, s, &t); }
template <register_vector V, register_tile S> TK_DEVICE void row_sum(V& d, const S& s, const V& acc) { V t = acc; reduce<op::add, true>(d, s, &t); }
template <register_vector V, register_tile S> TK_DEVICE void col_max(V& d, const S& s, const V& acc) { V t = acc; reduce<op::max, false>(d, s, &t); }
template <register_vector V, register_tile S> TK_DEVICE void col_min(V& d, const S& s, const V& acc) { V t = acc; reduce<op::min, false>(d, s, &t); }
template <register_vector V, register_tile S> TK_DEVICE void col_sum(V& d, const S& s, const V& acc) { V t = acc; reduce<op::add, false>(d, s, &t); }

// ---- tiles: layout swaps and transposes ----
// Same logical tile, other register layout (row <-> col), through warp shuffles. Register k of
// the destination comes from register 2*(k%2) + k/2 of lane (2*(lane%4)+j)*4 + lane/8, half (lane/4)%2,
// in both directions (the layouts are each other's transpose).
template <register_tile D, register_tile S> TK_DEVICE void swap_layout(D& dst, const S& src) {
    static_assert(D::rows == S::rows && D::cols == S::cols && !std::is_same_v<typename D::layout, typename S::layout>,
                  "swap_layout: same shape, other layout");
    const int lane = laneid(), half = (lane >> 2) & 1;
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        const auto& from = src.tiles[i][w].data[2 * (k & 1) + (k >> 1)];
        const int lane_s = (2 * (lane & 3) + j) * 4 + (lane >> 3);
        if constexpr (std::is_same_v<typename S::T, float>) {
            const float x = __shfl_sync(0xffffffff, from.x, lane_s), y = __shfl_sync(0xffffffff, from.y, lane_s);
            return half ? y : x;
        } else {
            uint32_t word = __shfl_sync(0xffffffff, as_u32(from), lane_s);
            typename S::T parts[2];
            __builtin_memcpy(parts, &word, 4);
            return convert<float>(parts[half]);
        }
    });
}
// dst = srcᵀ in the opposite layout: free (a col-layout tile's registers are its transpose's row layout).
template <register_tile D, register_tile S> TK_DEVICE void transpose_sep(D& dst, const S& src) {
    static_assert(D::rows == S::cols && D::cols == S::rows && !std::is_same_v<typename D::layout, typename S::layout> &&
                  std::is_same_v<typename D::T, typename S::T>, "transpose_sep: transposed shape, other layout, same type");
#pragma unroll
    for (int i = 0; i < S::height; ++i)
#pragma unroll
        for (int w = 0; w < S::width; ++w)
#pragma unroll
            for (int k = 0; k < 4; ++k) dst.tiles[w][i].data[k] = src.tiles[i][w].data[k];
}
// dst = srcᵀ in the same layout.
template <register_tile D, register_tile S> TK_DEVICE void transpose(D& dst, const S& src) {
    rt<typename S::T, S::cols, S::rows, std::conditional_t<S::is_row, col_layout, row_layout>> t;
    transpose_sep(t, src);
    swap_layout(dst, t);
}

// ---- base tiles: one element of a row or column, broadcast by shuffles (16-bit, row layout) ----
namespace detail {
template <class P> TK_DEVICE P shfl_pair(const P& p, int src_lane) {
    const uint32_t w = __shfl_sync(0xffffffffu, as_u32(p), src_lane);
    P out;
    __builtin_memcpy(&out, &w, 4);
    return out;
}
}  // namespace detail
// Element (lane/4 + 8H, C) of base tile t, the value in column C of this lane's row H, in both halves of a pair: a
// per-row factor for the lane's pairs in that row (feature maps built from a column of the inputs).
template <int C, int H, class T> TK_DEVICE packed_t<T> column_at(const rt_base<T, row_layout>& t) {
    static_assert(sizeof(T) == 2 && C >= 0 && C < BASE && (H == 0 || H == 1), "16-bit base tile, C < 16, H 0 or 1");
    const packed_t<T> p = detail::shfl_pair(t.data[H + 2 * (C / 8)], (laneid() & ~3) | ((C % 8) / 2));
    return C % 2 ? make_packed<T>(p.y, p.y) : make_packed<T>(p.x, p.x);
}
// Row r8 + 8H of base tile t at this lane's column pair Q (columns 2(lane%4) + 8Q, + 1): per-column factors for the
// lane's pairs in register H + 2Q of any tile with t's columns.
template <int H, int Q, class T> TK_DEVICE packed_t<T> row_pair_at(const rt_base<T, row_layout>& t, int r8) {
    static_assert(sizeof(T) == 2 && (H == 0 || H == 1) && (Q == 0 || Q == 1), "16-bit base tile, H and Q 0 or 1");
    return detail::shfl_pair(t.data[H + 2 * Q], r8 * 4 + (laneid() & 3));
}

// ---- vectors ----
template <register_vector V, class G> TK_DEVICE void vec_for_each(V& dst, G&& g) {
#pragma unroll
    for (int t = 0; t < V::tiles; ++t)
#pragma unroll
        for (int s = 0; s < V::per_base; ++s) dst.data[t][s] = convert<typename V::T>(g(t, s));
}
template <register_vector V> TK_DEVICE void fill(V& dst, float v) { vec_for_each(dst, [&](int, int) { return v; }); }
template <register_vector V> TK_DEVICE void zero(V& dst) { fill(dst, 0.f); }
template <register_vector V> TK_DEVICE void one(V& dst) { fill(dst, 1.f); }
template <register_vector V> TK_DEVICE void neg_infty(V& dst) { fill(dst, -INFINITY); }
template <register_vector V> TK_DEVICE void pos_infty(V& dst) { fill(dst, INFINITY); }
template <class F, register_vector D, register_vector S> TK_DEVICE void unary_map(D& dst, const S& src) {
    static_assert(D::length == S::length && std::is_same_v<typename D::layout, typename S::layout>, "vector shapes differ");
    vec_for_each(dst, [&](int t, int s) { return F::apply(detail::f(src.data[t][s])); });
}
template <class F, register_vector D, register_vector A, register_vector B> TK_DEVICE void bin_map(D& dst, const A& a, const B& b) {
    static_assert(D::length == A::length && D::length == B::length, "vector shapes differ");
    vec_for_each(dst, [&](int t, int s) { return F::apply(detail::f(a.data[t][s]), detail::f(b.data[t][s])); });
}
template <class F, register_vector D, register_vector A> TK_DEVICE void bin_map(D& dst, const A& a, float b) {
    vec_for_each(dst, [&](int t, int s) { return F::apply(detail::f(a.data[t][s]), b); });
}

// dst(r, c) = g(r, c, src(r, c)), with (r, c) the element's place in the whole tile: maps that depend on where an
// element sits (causal masks, decays by position, feature maps built from a row of inputs). src may be dst.
template <register_tile D, register_tile S, class G> TK_DEVICE void map_indexed(D& dst, const S& src, G&& g) {
    static_assert(D::rows == S::rows && D::cols == S::cols && std::is_same_v<typename D::layout, typename S::layout>,
                  "map_indexed: shapes or layouts differ");
    using L = typename D::layout;
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        return g(BASE * i + base_row<L>(k, j), BASE * w + base_col<L>(k, j), detail::get(src, i, w, k, j));
    });
}

// dst(r, c) = g(r, c, a(r, c), b(r, c)): the same with two sources of dst's shape and layout (a product masked by
// position, weighted by another product). a or b may be dst.
template <register_tile D, register_tile A, register_tile B, class G>
TK_DEVICE void map_indexed(D& dst, const A& a, const B& b, G&& g) {
    static_assert(D::rows == A::rows && D::cols == A::cols && std::is_same_v<typename D::layout, typename A::layout> &&
                  D::rows == B::rows && D::cols == B::cols && std::is_same_v<typename D::layout, typename B::layout>,
                  "map_indexed: shapes or layouts differ");
    using L = typename D::layout;
    detail::for_each(dst, [&](int i, int w, int k, int j) {
        return g(BASE * i + base_row<L>(k, j), BASE * w + base_col<L>(k, j), detail::get(a, i, w, k, j),
                 detail::get(b, i, w, k, j));
    });
}

// ---- named maps, for tiles and vectors alike ----
template <class X> concept register_value = register_tile<X> || register_vector<X>;
// copy also converts between element types (fp32 <-> bf16 / fp16).
template <register_value D, register_value S> TK_DEVICE void copy(D& dst, const S& src) { unary_map<op::copy>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void exp(D& dst, const S& src) { unary_map<op::exp>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void exp2(D& dst, const S& src) { unary_map<op::exp2>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void log(D& dst, const S& src) { unary_map<op::log>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void log2(D& dst, const S& src) { unary_map<op::log2>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void abs(D& dst, const S& src) { unary_map<op::abs>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void neg(D& dst, const S& src) { unary_map<op::neg>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void relu(D& dst, const S& src) { unary_map<op::relu>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void sqrt(D& dst, const S& src) { unary_map<op::sqrt>(dst, src); }
template <register_value D, register_value S> TK_DEVICE void rsqrt(D& dst, const S& src) { unary_map<op::rsqrt>(dst, src); }
// b is a tile/vector of the same shape, or a scalar.
template <register_value D, register_value A, class B> TK_DEVICE void add(D& dst, const A& a, const B& b) { bin_map<op::add>(dst, a, b); }
template <register_value D, register_value A, class B> TK_DEVICE void sub(D& dst, const A& a, const B& b) { bin_map<op::sub>(dst, a, b); }
template <register_value D, register_value A, class B> TK_DEVICE void mul(D& dst, const A& a, const B& b) { bin_map<op::mul>(dst, a, b); }
template <register_value D, register_value A, class B> TK_DEVICE void div(D& dst, const A& a, const B& b) { bin_map<op::div>(dst, a, b); }
template <register_value D, register_value A, class B> TK_DEVICE void max(D& dst, const A& a, const B& b) { bin_map<op::max>(dst, a, b); }
template <register_value D, register_value A, class B> TK_DEVICE void min(D& dst, const A& a, const B& b) { bin_map<op::min>(dst, a, b); }

}  // namespace tk
