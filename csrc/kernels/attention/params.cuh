// What the forward's and the backward's launch parameters (FwdParams, BwdParams) share, filled alike by their
// launches (forward_launch.cuh, backward_launch.cuh): the shapes from q and k, the mask and dropout from the score
// function.
#pragma once
#include <climits>

#include "attention.h"
#include "dropout.cuh"

namespace tk_attn {

template <class P>
inline void fill_shared_params(P& p, const View4& q, const View4& k, const Scores& sc) {
  p.B = q.B;
  p.Hq = q.H;
  p.Hkv = k.H;
  p.N = q.S;
  p.M = k.S;
  p.group = q.H / k.H;
  p.causal = sc.causal;
  p.window = sc.window > 0 ? sc.window : INT_MAX;
  p.drop = Dropout::of(sc.dropout);
}

}  // namespace tk_attn
