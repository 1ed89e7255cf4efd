// The services' command line on abseil flags, as an operator meets it: dashed and
// underscored names, --flagfile, --help, and one line with exit status 2 for every kind of
// bad flag, on all three binaries. NormalizeFlagNames on its own.
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/flags/parse.h"
#include "gtest/gtest.h"
#include "tests/model/test_util.h"
#include "tests/tools/run_binary.h"

namespace dxs {
namespace {

using testing::TempDir;

using Output = testing::ProcessOutput;

// Runs build/bin/`binary` `args` to completion.
Output RunService(const std::string& binary, const std::string& args, const TempDir& tmp) {
  return testing::RunBinary(binary + " " + args, tmp);
}

TEST(NormalizeFlagNames, DashesInNamesBecomeUnderscoresValuesStay) {
  EXPECT_EQ(
      flags::NormalizeFlagNames({"prog", "--metrics-listen", "0.0.0.0:9100", "--wire-dtype=f-32",
                                 "-lease-ms=5", "--", "--not-a-flag", "pos-arg"}),
      (std::vector<std::string>{"prog", "--metrics_listen", "0.0.0.0:9100", "--wire_dtype=f-32",
                                "-lease_ms=5", "--", "--not-a-flag", "pos-arg"}));
  EXPECT_EQ(flags::NormalizeFlagNames({"prog", "-", "--", "value-x"}),
            (std::vector<std::string>{"prog", "-", "--", "value-x"}));
}

TEST(ServiceFlags, EveryBadFlagIsOneLineAndExitTwo) {
  TempDir tmp;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"dxs-router", "--bogus"},
      {"dxs-router", "--model x --attention 1 --experts 1 --lease-ms 0"},
      {"dxs-router", "--model x --attention=many --experts 1"},
      {"dxs-router", "--model x --attention 1 --experts 1 stray"},
      {"dxs-attention", "--model x --router r:1"},
      {"dxs-attention", "--model x --rank 0 --router r:1 --kv-tokens 0"},
      {"dxs-attention", "--model x --rank 0 --router r:1 --low-latency-capacity -1"},
      {"dxs-attention", "--model x --rank 0 --router r:1 --low-latency-capacity 257"},
      {"dxs-attention", "--model x --rank 0 --router r:1 --listen nowhere"},
      {"dxs-attention", "--model x --rank 0 --router r:1 --tls-cert a.pem"},
      {"dxs-expert", "--model x --rank 0 --router r:1 --experts 3-1"},
      {"dxs-expert", "--model x --rank -4 --router r:1"},
      {"dxs-expert", "--frobnicate=1"},
      {"dxs-expert", "--model x --rank 0 --router r:1 --transport nccl"},
      {"dxs-attention", "--model x --rank 0 --router r:1 --transport shm"},
  };
  for (const auto& [binary, args] : cases) {
    const Output o = RunService(binary, args, tmp);
    EXPECT_EQ(o.exit_code, 2) << binary << " " << args << ": " << o.err;
    EXPECT_EQ(std::count(o.err.begin(), o.err.end(), '\n'), 1)
        << binary << " " << args << ": " << o.err;
    EXPECT_EQ(o.err.rfind(binary + ": ", 0), 0u) << o.err;
  }
}

TEST(ServiceFlags, DashesAndUnderscoresNameTheSameFlag) {
  TempDir tmp;
  for (const char* spelling : {"--wire-dtype", "--wire_dtype"}) {
    const Output o = RunService(
        "dxs-router", absl::StrCat("--model x --attention 1 --experts 1 ", spelling, " f64"), tmp);
    EXPECT_EQ(o.exit_code, 2);
    EXPECT_EQ(o.err, "dxs-router: --wire-dtype must be f32, bf16 or fp8, got 'f64'\n");
  }
}

// The workers' --transport (worker/worker_transport.h): nccl moves GPU memory, so it needs a
// GPU device; the message names the flag and what it needs.
TEST(ServiceFlags, WorkerTransportNcclNeedsAGpuDevice) {
  TempDir tmp;
  for (const char* binary : {"dxs-attention", "dxs-expert"}) {
    Output o = RunService(binary, "--model x --rank 0 --router r:1 --transport nccl", tmp);
    EXPECT_EQ(o.exit_code, 2);
    EXPECT_EQ(o.err, absl::StrCat(binary,
                                  ": --transport nccl moves GPU memory: it needs --device cuda "
                                  "or cuda:N, not --device cpu\n"));
    o = RunService(binary, "--model x --rank 0 --router r:1 --transport shm", tmp);
    EXPECT_EQ(o.exit_code, 2);
    EXPECT_EQ(o.err, absl::StrCat(binary, ": --transport must be ucx or nccl, got 'shm'\n"));
  }
}

// A --kv-tokens pool the device cannot hold fails the attention worker's start, naming the
// flag (--kv-preallocate, the default), before it registers anywhere: not a step later.
TEST(ServiceFlags, AKvPoolThatDoesNotFitFailsTheStart) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  // 10^13 positions of the default preset: petabytes.
  const Output o = RunService(
      "dxs-attention",
      "--model " + dir + " --rank 0 --router 127.0.0.1:1 --kv-tokens 10000000000000", tmp);
  EXPECT_EQ(o.exit_code, 2) << o.err;
  EXPECT_NE(o.err.find("dxs-attention: --kv-tokens 10000000000000: the KV pool does not fit"),
            std::string::npos)
      << o.err;
}

TEST(ServiceFlags, AFlagfileIsAConfigFile) {
  TempDir tmp;
  const std::string file = tmp.path() + "/router.flags";
  std::ofstream(file) << "--model=/no/such/model\n--attention=2\n--experts=2\n--lease_ms=900\n";
  // The flags are all good, so it gets as far as the model, which is not there.
  Output o = RunService("dxs-router", "--flagfile=" + file, tmp);
  EXPECT_EQ(o.exit_code, 1) << o.err;
  EXPECT_NE(o.err.find("/no/such/model"), std::string::npos) << o.err;
  // A bad value in the file is a bad flag like any other; the command line comes after it.
  std::ofstream(file) << "--model=/no/such/model\n--attention=2\n";
  o = RunService("dxs-router", "--flagfile " + file, tmp);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_EQ(o.err, "dxs-router: --experts is required\n");
  o = RunService("dxs-router", "--flagfile " + file + " --experts=0", tmp);
  EXPECT_EQ(o.err, "dxs-router: --experts is required\n");
  o = RunService("dxs-router", "--flagfile " + file + " --experts=70000", tmp);
  EXPECT_EQ(o.err, "dxs-router: --experts must be in 1..65536\n");
}

TEST(ServiceFlags, HelpListsTheServicesOwnFlagsAndExitsZero) {
  TempDir tmp;
  for (const char* binary : {"dxs-router", "dxs-attention", "dxs-expert"}) {
    Output o = RunService(binary, "--help", tmp);
    EXPECT_EQ(o.exit_code, 0) << binary << o.err;
    EXPECT_NE(o.out.find("usage: " + std::string(binary)), std::string::npos) << o.out;
    EXPECT_NE(o.out.find("--metrics_listen"), std::string::npos) << o.out;
    EXPECT_NE(o.out.find("--tls_cert"), std::string::npos) << o.out;
    EXPECT_EQ(o.out.find("--flagfile ("), std::string::npos) << "abseil's own flags: --helpfull";
    o = RunService(binary, "--helpfull", tmp);
    EXPECT_EQ(o.exit_code, 0) << binary << o.err;
    EXPECT_NE(o.out.find("--flagfile"), std::string::npos) << o.out;
    o = RunService(binary, "--version", tmp);
    EXPECT_EQ(o.exit_code, 0) << binary << o.err;
  }
  EXPECT_NE(RunService("dxs-attention", "--help", tmp).out.find("--kv_tokens"), std::string::npos);
  EXPECT_NE(RunService("dxs-expert", "--help", tmp).out.find("--experts"), std::string::npos);
}

// A bad DXS_* environment value (common/tunables.h) stops every service at start-up with
// the services' one line and exit status 2, before the flags are checked.
TEST(ServiceFlags, BadTunableIsOneLineAndExitTwo) {
  TempDir tmp;
  setenv("DXS_CUDA_PDL", "of", 1);
  for (const std::string binary : {"dxs-router", "dxs-attention", "dxs-expert"}) {
    const Output o = RunService(binary, "", tmp);
    EXPECT_EQ(o.exit_code, 2) << binary << ": " << o.err;
    EXPECT_EQ(o.err, binary + ": DXS_CUDA_PDL=of: expected auto or off\n");
  }
  unsetenv("DXS_CUDA_PDL");
}

}  // namespace
}  // namespace dxs
