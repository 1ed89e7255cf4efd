// SplitMix64 (Steele, Lea and Flood): the counter-based generator behind dxs's seeded
// random checkpoints and sampling. Output i of a stream seeded with s is
// SplitMix64Mix(s + (i + 1) * kSplitMix64Gamma), so any element can be computed on its own:
// the CUDA backend fills random weights in parallel with exactly the host's values.
// Free of other headers so that .cu files can include it.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dxs {

inline constexpr uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ull;

DXS_HOST_DEVICE inline uint64_t SplitMix64Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The next output of the stream whose state is *state.
DXS_HOST_DEVICE inline uint64_t SplitMix64Next(uint64_t* state) {
  return SplitMix64Mix(*state += kSplitMix64Gamma);
}

// Output i (from 0) of the stream seeded with `seed`, on its own: the state after i + 1
// steps is seed + (i + 1) * gamma.
DXS_HOST_DEVICE inline uint64_t SplitMix64At(uint64_t seed, uint64_t i) {
  return SplitMix64Mix(seed + (i + 1) * kSplitMix64Gamma);
}

// A uniform double in [0, 1) from an output's top 53 bits.
DXS_HOST_DEVICE inline double SplitMix64Unit(uint64_t bits) {
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

}  // namespace dxs

#undef DXS_HOST_DEVICE
