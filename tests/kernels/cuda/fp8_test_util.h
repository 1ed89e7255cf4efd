// Shared by the FP8 CUDA tests: the FP8 recipe on the host, against which the kernels are
// checked (a weight quantized as the official checkpoints are, activations quantized per 128
// values as the backend's passes do).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "model/random_checkpoint.h"

namespace dxs::testing {

// A block-scaled FP8 weight on the host: e4m3 bytes [n, k] and scales [n / 128, k / 128].
struct HostFp8Weight {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
  double At(int64_t r, int64_t c) const {
    return static_cast<double>(Fp8E4m3ToFloat(bytes[r * k + c])) *
           scales[(r / 128) * (k / 128) + c / 128];
  }
};

// w [n, k] quantized as gen-model --fp8 quantizes (QuantizeFp8Blocks).
inline HostFp8Weight QuantizeHostFp8Weight(const std::vector<float>& w, int64_t n, int64_t k) {
  HostFp8Weight out{n, k, {}, {}};
  std::vector<float> q;
  QuantizeFp8Blocks(w, n, k, &q, &out.scales);
  out.bytes.resize(q.size());
  for (size_t i = 0; i < q.size(); ++i) out.bytes[i] = FloatToFp8E4m3(q[i]);
  return out;
}

// Each run of 128 values quantized as the backend's passes do (scale max(amax, 1e-4) / 448,
// the value / scale rounded to e4m3), back in float. Rows whose length is a multiple of 128
// quantize per row and 128 channels.
inline std::vector<float> QuantizedGroups(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t g = 0; g < v.size() / 128; ++g) {
    float amax = 0;
    for (size_t j = g * 128; j < (g + 1) * 128; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float scale = std::max(amax, 1e-4f) / kFp8E4m3Max;
    for (size_t j = g * 128; j < (g + 1) * 128; ++j) {
      out[j] = Fp8E4m3ToFloat(FloatToFp8E4m3(v[j] / scale)) * scale;
    }
  }
  return out;
}

}  // namespace dxs::testing
