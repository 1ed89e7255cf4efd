// gpu_host_call_probe: which host calls of the CUDA runtime hold back kernels launched
// after them while a kernel on another stream spins. The low-latency exchange's ranks in one
// process (expert_service/local_low_latency_experts.h) depend on the answer: a rank's wait
// spins until another rank's kernels run, so a call that makes later launches wait for the
// earlier ones (an implicit synchronisation) stalls the step until the wait times out.
//
// Each case: a kernel on stream A spins on a device flag (timeout 1 s, the GPU's global
// timer); the host makes the call under test; then a kernel on stream B sets the flag. The
// case prints the call's host time and whether the spin saw the flag (the call let B run
// beside A) or timed out (B was held behind A: the call synchronised). Streams are
// non-blocking, as the CUDA backend's are. The last cases queue a copy on A behind the spin
// first (pinned, or pageable from another thread): on the H200, a cudaMemcpy to pageable
// memory waits while another thread's pageable copy waits in its stream (the driver stages
// them one at a time); pinned copies and kernels do not. Run it under
// CUDA_MODULE_LOADING=LAZY and EAGER for the "first launch of a kernel" case.
//   gpu_host_call_probe [--json FILE]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr unsigned long long kTimeoutNs = 1'000'000'000ull;

__device__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag reaches want; *result: 1 saw it, 2 timed out.
__global__ void SpinKernel(const volatile int* flag, int want, int* result) {
  const unsigned long long start = GlobalTimerNs();
  while (*flag < want) {
    if (GlobalTimerNs() - start > kTimeoutNs) {
      *result = 2;
      return;
    }
    __nanosleep(1000);
  }
  *result = 1;
}

__global__ void SetKernel(volatile int* flag, int value) {
  *flag = value;
  __threadfence_system();
}

// Kernels launched once each, the first time in their case (lazy loading loads them then).
template <int N>
__global__ void FirstLaunchKernel(int* p) {
  p[N] += N;
}

__global__ void TouchKernel(int* p) { p[0] += 1; }

// A device word into mapped host memory: a read that needs no copy engine.
__global__ void ReadIntoMappedKernel(const int* src, volatile int* mapped) { *mapped = *src; }

bool Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "gpu_host_call_probe: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

struct Result {
  std::string call;
  double host_ms = 0;
  bool held = false;  // the spin timed out: the setter ran only after it
};

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gpu_host_call_probe [--json FILE]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "gpu_host_call_probe: no GPU here\n");
    return 1;
  }
  cudaStream_t a, b, c;
  int* flag = nullptr;
  int* result = nullptr;
  int* scratch = nullptr;
  int* pinned = nullptr;
  int* mapped = nullptr;  // pinned, mapped into the device's address space
  int* mapped_device = nullptr;
  if (!Check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "stream") ||
      !Check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "stream") ||
      !Check(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking), "stream") ||
      !Check(cudaMalloc(&flag, sizeof(int)), "flag") ||
      !Check(cudaMalloc(&result, sizeof(int)), "result") ||
      !Check(cudaMalloc(&scratch, 1 << 20), "scratch") ||
      !Check(cudaHostAlloc(&pinned, 4096, cudaHostAllocDefault), "pinned") ||
      !Check(cudaHostAlloc(&mapped, 4096, cudaHostAllocMapped), "mapped") ||
      !Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_device), mapped, 0),
             "mapped") ||
      !Check(cudaMemset(flag, 0, sizeof(int)), "memset") ||
      !Check(cudaMemset(scratch, 0, 1 << 20), "memset")) {
    return 1;
  }
  TouchKernel<<<1, 1, 0, c>>>(scratch);
  cudaDeviceSynchronize();
  // A small graph, recorded once, for the instantiate and upload cases.
  cudaGraph_t graph = nullptr;
  cudaStreamBeginCapture(c, cudaStreamCaptureModeRelaxed);
  TouchKernel<<<1, 1, 0, c>>>(scratch);
  cudaStreamEndCapture(c, &graph);
  cudaGraphExec_t launched_exec = nullptr;
  cudaGraphInstantiate(&launched_exec, graph, 0);
  cudaGraphLaunch(launched_exec, c);
  cudaStreamSynchronize(c);
  void* to_free = nullptr;
  void* to_free_host = nullptr;
  int host_word = 0;
  std::vector<char> pageable(1 << 20);

  // Eight more streams: the ninth made (more[5]) shares A's hardware queue when the
  // runtime deals streams round-robin over CUDA_DEVICE_MAX_CONNECTIONS (8 by default).
  std::vector<cudaStream_t> more(8);
  for (cudaStream_t& s : more) {
    if (!Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream")) return 1;
  }
  std::vector<cudaGraphExec_t> made;  // a case's graphs, destroyed after it
  struct Case {
    const char* name;
    std::function<void()> before;  // untimed set-up, before the spin starts
    std::function<void()> call;
    bool spin_in_graph = false;          // the spin is a graph's node, launched as a graph
    bool set_in_graph = false;           // so is the setter
    cudaStream_t* set_stream = nullptr;  // B unless given
    // Untimed, right after the spin: more work on A, queued behind it (the attention rank's
    // copy of its step's tokens behind the step's waits).
    std::function<void()> queued = [] {};
  };
  // A small D2H copy on A behind the spin: it cannot start until the spin ends.
  const auto copy_queued_on_a = [&] {
    cudaMemcpyAsync(pinned + 1, scratch, sizeof(int), cudaMemcpyDeviceToHost, a);
  };
  // A D2H copy to pageable memory on A, from another thread (it returns only when done:
  // the engine's Download of a step's logits).
  std::vector<std::thread> copiers;
  int pageable_word = 0;
  const auto pageable_copy_queued_on_a = [&] {
    copiers.emplace_back([&] {
      cudaMemcpyAsync(&pageable_word, scratch, sizeof(int), cudaMemcpyDeviceToHost, a);
      cudaStreamSynchronize(a);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // the copy is queued
  };
  const auto h2d_queued_on_a = [&] {
    cudaMemcpyAsync(scratch, pinned + 1, sizeof(int), cudaMemcpyHostToDevice, a);
  };
  // Three ways to read a device word on the host: a pageable copy, a pinned copy on C, a
  // kernel on C into mapped memory.
  const std::function<void()> read_pageable = [&] {
    cudaMemcpy(&host_word, scratch, sizeof(int), cudaMemcpyDeviceToHost);
  };
  const std::function<void()> read_pinned = [&] {
    cudaMemcpyAsync(pinned, scratch, sizeof(int), cudaMemcpyDeviceToHost, c);
    cudaStreamSynchronize(c);
  };
  const std::function<void()> read_mapped = [&] {
    ReadIntoMappedKernel<<<1, 1, 0, c>>>(scratch, mapped_device);
    cudaStreamSynchronize(c);
    host_word = *static_cast<volatile int*>(mapped);
  };
  const std::vector<Case> cases = {
      {"nothing", [] {}, [] {}},
      {"cudaMemcpy D2H to pageable (legacy stream)", [] {}, read_pageable},
      {"cudaMemcpyAsync D2H to pageable + stream sync", [] {},
       [&] {
         cudaMemcpyAsync(&host_word, scratch, sizeof(int), cudaMemcpyDeviceToHost, c);
         cudaStreamSynchronize(c);
       }},
      {"cudaMemcpyAsync D2H to pinned + stream sync", [] {}, read_pinned},
      {"cudaMemcpyAsync H2D 1 MiB from pageable + stream sync", [] {},
       [&] {
         cudaMemcpyAsync(scratch, pageable.data(), pageable.size(), cudaMemcpyHostToDevice, c);
         cudaStreamSynchronize(c);
       }},
      {"cudaMemsetAsync", [] {}, [&] { cudaMemsetAsync(scratch, 0, 4096, c); }},
      {"cudaMemset (legacy stream)", [] {}, [&] { cudaMemset(scratch, 0, 4096); }},
      {"cudaMalloc 1 MiB", [] {},
       [&] {
         void* p = nullptr;
         cudaMalloc(&p, 1 << 20);
         to_free = p;
       }},
      {"cudaMalloc 512 MiB", [&] { cudaFree(to_free); },
       [&] {
         void* p = nullptr;
         cudaMalloc(&p, 512ull << 20);
         to_free = p;
       }},
      {"cudaFree", [] {}, [&] { cudaFree(to_free); }},
      {"cudaMallocAsync 1 MiB + cudaFreeAsync", [] {},
       [&] {
         void* p = nullptr;
         cudaMallocAsync(&p, 1 << 20, c);
         cudaFreeAsync(p, c);
       }},
      {"cudaHostAlloc 64 KiB", [] {},
       [&] { cudaHostAlloc(&to_free_host, 64 << 10, cudaHostAllocDefault); }},
      {"cudaFreeHost", [] {}, [&] { cudaFreeHost(to_free_host); }},
      {"cudaEventCreate + cudaEventDestroy", [] {},
       [&] {
         cudaEvent_t e;
         cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
         cudaEventDestroy(e);
       }},
      {"cudaGraphLaunch of a launched graph", [] {}, [&] { cudaGraphLaunch(launched_exec, c); }},
      {"cudaGraphInstantiate", [] {},
       [&] {
         cudaGraphExec_t exec;
         cudaGraphInstantiate(&exec, graph, 0);
         made.push_back(exec);
       }},
      {"cudaGraphInstantiate + cudaGraphUpload + first launch", [] {},
       [&] {
         cudaGraphExec_t exec;
         cudaGraphInstantiate(&exec, graph, 0);
         cudaGraphUpload(exec, c);
         cudaGraphLaunch(exec, c);
         made.push_back(exec);
       }},
      {"a kernel's first launch", [] {}, [&] { FirstLaunchKernel<1><<<1, 1, 0, c>>>(scratch); }},
      {"a kernel's first launch (another module function)", [] {},
       [&] { FirstLaunchKernel<2><<<1, 1, 0, c>>>(scratch); }},
      // No call: how the spin and the setter are launched.
      {"(none; the setter is a graph)", [] {}, [] {}, false, true},
      {"(none; the spin is a graph)", [] {}, [] {}, true, false},
      {"(none; both are graphs)", [] {}, [] {}, true, true},
      {"(none; the setter on the 9th stream made, after A)", [] {}, [] {}, false, false, &more[5]},
      {"(none; both graphs, the setter on the 9th stream made)", [] {}, [] {}, true, true,
       &more[5]},
      // A copy queued on A behind the spin, then a read of another stream (an expert rank
      // reading its status while the attention rank's step waits for it).
      {"cudaMemcpy D2H to pageable, a D2H copy queued on A", [] {}, read_pageable, false, false,
       nullptr, copy_queued_on_a},
      {"cudaMemcpyAsync D2H to pinned + sync, a D2H copy queued on A", [] {}, read_pinned, false,
       false, nullptr, copy_queued_on_a},
      {"cudaMemcpyAsync H2D from pinned + sync, a D2H copy queued on A", [] {},
       [&] {
         cudaMemcpyAsync(scratch, pinned, sizeof(int), cudaMemcpyHostToDevice, c);
         cudaStreamSynchronize(c);
       },
       false, false, nullptr, copy_queued_on_a},
      {"cudaMemcpyAsync D2H to pinned + sync, an H2D copy queued on A", [] {}, read_pinned, false,
       false, nullptr, h2d_queued_on_a},
      {"a kernel into mapped host memory + sync, a D2H copy queued on A", [] {}, read_mapped, false,
       false, nullptr, copy_queued_on_a},
      {"cudaMemcpy D2H to pageable, a pageable D2H copy queued on A", [] {}, read_pageable, false,
       false, nullptr, pageable_copy_queued_on_a},
      {"cudaMemcpyAsync D2H to pinned + sync, a pageable D2H copy queued on A", [] {}, read_pinned,
       false, false, nullptr, pageable_copy_queued_on_a},
      {"a kernel into mapped host memory + sync, a pageable D2H copy queued on A", [] {},
       read_mapped, false, false, nullptr, pageable_copy_queued_on_a},
  };
  using Launch = std::function<void(cudaStream_t)>;
  // A kernel launch recorded as a one-node graph and instantiated (untimed).
  auto as_graph = [&](const Launch& launch) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaStreamBeginCapture(c, cudaStreamCaptureModeRelaxed);
    launch(c);
    cudaStreamEndCapture(c, &g);
    cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    cudaGraphUpload(exec, c);
    cudaStreamSynchronize(c);
    made.push_back(exec);
    return exec;
  };
  // The launch itself, or the graph that holds it where there is one.
  auto run = [](cudaGraphExec_t graph, cudaStream_t s, const Launch& launch) {
    if (graph != nullptr) {
      cudaGraphLaunch(graph, s);
    } else {
      launch(s);
    }
  };

  std::vector<Result> results;
  int round = 0;
  for (const Case& k : cases) {
    ++round;
    k.before();
    const int want = round;
    const Launch spin = [&](cudaStream_t s) { SpinKernel<<<1, 1, 0, s>>>(flag, want, result); };
    const Launch set = [&](cudaStream_t s) { SetKernel<<<1, 1, 0, s>>>(flag, want); };
    const cudaGraphExec_t spin_graph = k.spin_in_graph ? as_graph(spin) : nullptr;
    const cudaGraphExec_t set_graph = k.set_in_graph ? as_graph(set) : nullptr;
    if (!Check(cudaDeviceSynchronize(), k.name)) return 1;
    run(spin_graph, a, spin);
    k.queued();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the spin is running
    const auto t0 = std::chrono::steady_clock::now();
    k.call();
    const auto t1 = std::chrono::steady_clock::now();
    run(set_graph, k.set_stream != nullptr ? *k.set_stream : b, set);
    if (!Check(cudaStreamSynchronize(a), k.name) || !Check(cudaDeviceSynchronize(), k.name)) {
      return 1;
    }
    for (std::thread& t : copiers) t.join();
    copiers.clear();
    for (cudaGraphExec_t exec : made) cudaGraphExecDestroy(exec);
    made.clear();
    int r = 0;
    cudaMemcpy(&r, result, sizeof(int), cudaMemcpyDeviceToHost);
    Result out;
    out.call = k.name;
    out.host_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    out.held = r != 1;
    results.push_back(out);
  }
  const char* mode = std::getenv("CUDA_MODULE_LOADING");
  std::printf(
      "gpu_host_call_probe: a kernel on stream A spins (1 s timeout) while the host makes "
      "the call, then stream B sets its flag (CUDA_MODULE_LOADING=%s)\n",
      mode != nullptr ? mode : "(unset)");
  std::printf("  %-55s %10s  %s\n", "call", "host ms", "later launches");
  FILE* f = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
  for (const Result& r : results) {
    std::printf("  %-55s %10.3f  %s\n", r.call.c_str(), r.host_ms,
                r.held ? "HELD behind the spin (timed out)" : "ran beside it");
    if (f != nullptr) {
      std::fprintf(f, "{\"call\": \"%s\", \"host_ms\": %.3f, \"held\": %s, \"loading\": \"%s\"}\n",
                   r.call.c_str(), r.host_ms, r.held ? "true" : "false",
                   mode != nullptr ? mode : "");
    }
  }
  if (f != nullptr) std::fclose(f);
  return 0;
}
