// Helpers shared by the model tests: temporary directories and preset checkpoints.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/random_checkpoint.h"

namespace dxs::testing {

// A fresh directory under $TMPDIR, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dxs_test_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes preset `name` into a subdirectory of `dir` and returns its path.
// With `router_skew` > 0, the preset's routing Zipf-skewed that much (uneven expert load,
// for EPLB), written to "<name>-skewed".
inline std::string WritePreset(const TempDir& dir, const std::string& name, double router_skew = 0,
                               bool fp8 = false) {
  const std::string out =
      dir.path() + "/" + name + (router_skew > 0 ? "-skewed" : "") + (fp8 ? "-fp8" : "");
  auto preset = GetPreset(name);
  EXPECT_TRUE(preset.ok()) << preset.status();
  if (router_skew > 0) preset->router_skew = router_skew;
  preset->fp8 = fp8;
  auto s = WriteRandomCheckpoint(*preset, out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// max |a - b| / max |b|: relative to the reference's scale, so near-zero logits don't
// dominate. The measure behind every "within 1e-N relative" check.
inline double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
  }
  return max_diff / max_ref;
}

inline std::string SourceDir() {
  const char* d = std::getenv("DXS_SOURCE_DIR");
#ifdef DXS_TEST_SOURCE_DIR
  return d ? d : DXS_TEST_SOURCE_DIR;
#else
  return d ? d : ".";
#endif
}

}  // namespace dxs::testing
