// RunBinary: runs one of the build's binaries (DXS_TEST_BIN_DIR, defined by the test's
// target) to completion with stdin from /dev/null, capturing its exit code, stdout and
// stderr through files in a test's temporary directory.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/model/test_util.h"

namespace dxs::testing {

struct ProcessOutput {
  int exit_code = -1;  // -1: it did not exit normally
  std::string out, err;
};

inline std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// `command` is the binary's name and its arguments, as a shell line.
inline ProcessOutput RunBinary(const std::string& command, const TempDir& tmp) {
  const std::string out = tmp.path() + "/out.txt", err = tmp.path() + "/err.txt";
  const std::string line =
      absl::StrCat(DXS_TEST_BIN_DIR, "/", command, " >", out, " 2>", err, " </dev/null");
  const int status = std::system(line.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(out), Slurp(err)};
}

}  // namespace dxs::testing
