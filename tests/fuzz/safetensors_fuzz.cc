// libFuzzer target: SafetensorsFile::FromBytes on arbitrary bytes, then every tensor it
// accepts is widened to float32 the way Checkpoint::ReadFloat32 does. With ASan, any read
// outside the input or any inconsistency between the header and the views is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "safetensors_fuzz: invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto file = dxs::SafetensorsFile::FromBytes(bytes, "fuzz.safetensors");
  if (!file.ok()) {
    Check(file.status().code() == absl::StatusCode::kInvalidArgument,
          "bad input is INVALID_ARGUMENT");
    Check(file.status().message().find("fuzz.safetensors") != absl::string_view::npos,
          "error names the file");
    return 0;
  }
  const uint8_t* end = data + size;
  std::vector<float> widened;
  for (const auto& [name, view] : (*file)->tensors()) {
    Check(name == view.name, "map key equals view name");
    int64_t num_elements = 1;
    for (int64_t d : view.shape) {
      Check(d >= 0, "dimensions are non-negative");
      num_elements *= d;  // cannot overflow: the bytes below are inside the input
    }
    Check(num_elements == view.num_elements(), "num_elements");
    Check(view.num_bytes == static_cast<size_t>(num_elements) * dxs::DTypeSize(view.dtype),
          "num_bytes matches shape and dtype");
    Check(view.data >= data + 8 && view.data <= end && view.num_bytes <= size_t(end - view.data),
          "tensor bytes lie inside the input");
    auto found = (*file)->Find(name);
    Check(found.ok() && *found == &view, "Find returns the view");
    // As ReadFloat32: widen every element (unaligned reads go through memcpy).
    widened.assign(static_cast<size_t>(num_elements), 0.0f);
    dxs::WidenToFloat32(view.dtype, view.data, widened.size(), widened.data());
    // Narrowing back must give the same bits for finite values (exact round trip).
    std::vector<uint8_t> narrowed(view.num_bytes);
    dxs::NarrowFromFloat32(view.dtype, widened.data(), widened.size(), narrowed.data());
    for (size_t i = 0; i < widened.size(); ++i) {
      if (widened[i] != widened[i]) continue;  // NaN payloads may change
      const size_t width = dxs::DTypeSize(view.dtype);
      Check(std::memcmp(narrowed.data() + i * width, view.data + i * width, width) == 0,
            "widen then narrow is exact");
    }
  }
  for (const auto& [key, value] : (*file)->metadata()) {
    Check(key.size() + value.size() <= size, "metadata comes from the header");
  }
  const char* absent = "\x01not a tensor name";
  if ((*file)->tensors().count(absent) == 0) {
    Check((*file)->Find(absent).status().code() == absl::StatusCode::kNotFound,
          "Find of an absent name is NOT_FOUND");
  }
  return 0;
}
