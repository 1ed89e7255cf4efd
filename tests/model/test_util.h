// Helpers shared by the model tests: temporary directories and preset checkpoints.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

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
inline std::string WritePreset(const TempDir& dir, const std::string& name) {
  const std::string out = dir.path() + "/" + name;
  auto preset = GetPreset(name);
  EXPECT_TRUE(preset.ok()) << preset.status();
  auto s = WriteRandomCheckpoint(*preset, out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
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
