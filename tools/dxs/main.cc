// dxs: the command-line tool. `dxs help` lists the subcommands; `dxs CMD --help` (or
// `dxs help CMD`) prints one command's usage.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "common/tunables.h"
#include "tools/dxs/commands.h"
#include "tools/dxs/sampling_flags.h"

namespace {

struct Command {
  const char* name;
  const char* summary;  // one line, for `dxs help`
  const char* usage;    // the flags, for `dxs NAME --help`
  int (*run)(const std::vector<std::string>&);
  const char* more_usage = nullptr;  // flags shared with another command, printed after usage
};

constexpr char kDeviceNote[] =
    "--device: cpu (default), or a GPU where dxs was built with CUDA; a GPU asked for and\n"
    "  not there is a clear error (exit 1)\n";
constexpr char kTlsNote[] = "TLS: --tls-cert FILE --tls-key FILE --tls-ca FILE [--mtls]\n";

const Command kCommands[] = {
    {"run", "generate with the single-process engine",
     "  --model DIR (default: the embedded model) --prompt-ids 1,2,3\n"
     "  --max-new-tokens N [--temperature T --top-p P --top-k K --seed S]\n"
     "  [--stop-ids a,b] [--ignore-eos] [--prefill-chunk N] [--dump-logits]\n"
     "  [--format json|text] [--device cpu|cuda[:N]]\n"
     "  [--preset NAME instead of --model: a gen-model preset made in place]\n"
     "  [--eager (no CUDA graphs for decode steps)]\n"
     "  [--overlap-schedule on|off (decode steps queued behind the running one; on)]\n",
     dxs::cli::RunCommand, dxs::cli::kSamplingUsage},
    {"gen-model", "write a seeded random checkpoint",
     "  --out DIR [--preset default|odd|bf16-sharded|qwen3-30b-a3b] [--seed S]\n"
     "  [--router-skew S (Zipf exponent of expert popularity; 0: uniform-ish, the weights\n"
     "  as drawn)] [--layers N (the preset's first N layers only)]\n"
     "  [--in-place (config.json and a recipe only: every process that opens DIR makes the\n"
     "  same weights on its own device; a full-size shape on a small disk)]\n"
     "  [--fp8 (block-scaled FP8 weights, 128x128 blocks, as the official Qwen3-FP8\n"
     "  checkpoints: attention and expert projections in F8_E4M3 with weight_scale_inv)]\n",
     dxs::cli::GenModelCommand},
    {"fingerprint", "print a checkpoint's fingerprint", "  --model DIR\n",
     dxs::cli::FingerprintCommand},
    {"up", "start a local cluster (router, attention and expert workers)",
     "  [--model DIR] --attention M --experts N [--port P] [--log-dir DIR]\n"
     "  [--wire-dtype f32|bf16|fp8]\n"
     "  [--overlap-min-tokens N (two-batch overlap from N tokens a step; 0: off)]\n"
     "  [--stream-interval N (tokens per streamed chunk after the first; 1)]\n"
     "  [--piecewise-graphs true|false (GPU decode steps between exchanges as recorded\n"
     "  CUDA graphs; true)]\n"
     "  [--mapped-exchange true|false (rows through the attention rank's memory, which the\n"
     "  expert ranks map: one copy; true)]\n"
     "  [--overlap-schedule true|false (decode steps queued behind the running one while\n"
     "  the host streams its tokens; true)]\n"
     "  [--low-latency-capacity N (GPU decode steps of at most N tokens a DP rank over the\n"
     "  low-latency exchange; 0: off)]\n"
     "  [--device cpu|cuda[:N] (where the workers compute; cpu)]\n"
     "  [--gpus 0,1,... (attention ranks, then expert ranks, on these GPUs in turn;\n"
     "  implies --device cuda)]\n"
     "  [--transport ucx|nccl (the data path's; nccl: GPU memory over one NCCL\n"
     "  communicator, every worker on a GPU; ucx)]\n"
     "  [--num-redundant-experts R (expert replicas; dxs-router's flag)]\n"
     "  [--eplb-interval N (EPLB live: rebalance every N steps)]\n"
     "  [--elastic-ep (dxs-router's flag: lost or drained EP ranks' experts move to live\n"
     "  ranks; an expert worker that dies is started again)]\n"
     "  [--served-model-name NAME (the model's name through the gateway; the --model\n"
     "  directory's last component)]\n"
     "  [--gateway-port P (the SMG gateway in front of the router: OpenAI's API on\n"
     "  http://127.0.0.1:P/v1) [--gateway-metrics-port Q (P+1)] [--smg PATH (the .venv's)]]\n"
     "  Prints 'listening on ADDR' when healthy (and the gateway's address once it serves);\n"
     "  stops everything on Ctrl-C or SIGTERM.\n",
     dxs::cli::UpCommand},
    {"generate", "stream tokens for a prompt from a router",
     "  --router ADDR --prompt-ids 1,2,3 [--max-new-tokens N]\n"
     "  [--temperature T --top-p P --top-k K --seed S] [--stop-ids a,b] [--ignore-eos]\n"
     "  [--dp-rank R] [--request-id ID] [--format json|text]\n",
     dxs::cli::GenerateCommand, dxs::cli::kSamplingUsage},
    {"status", "list a cluster's workers, addresses, loads and expert placement",
     "  --router ADDR [--format json]\n", dxs::cli::StatusCommand},
    {"rebalance", "one EPLB rebalance now (placement from measured load)", "  --router ADDR\n",
     dxs::cli::RebalanceCommand},
    {"drain", "stop sending work to a rank (an EP rank's experts move off first, then it exits)",
     "  --router ADDR --rank N [--role expert|attention]\n", dxs::cli::DrainCommand},
    {"bench", "throughput and latency percentiles against a router or the local engine",
     "  --router ADDR | --local MODEL  [--concurrency C --requests R --prompt-len L\n"
     "  --output-len O] [--format json] [--device cpu|cuda[:N] (with --local)]\n"
     "  [--warmup-requests N (untimed first; closed loop: one a lane, open loop: 1)]\n"
     "  open loop: --request-rate R1,R2,...|inf (Poisson arrivals, --requests\n"
     "  a rate; --concurrency caps those in flight) [--len-sigma S (log-normal lengths\n"
     "  around --prompt-len/--output-len) --seed N --slo-ttft-ms 1000 --slo-tpot-ms 50]\n"
     "  [--overlap-schedule on|off (with --local: overlap scheduling; on)]\n",
     dxs::cli::BenchCommand},
    {"tunables", "list the DXS_* environment variables dxs reads, with their values here",
     "  [--markdown (the table of docs/tunables.md)]\n", dxs::cli::TunablesCommand},
};

const Command* Find(const std::string& name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

void PrintUsage(std::ostream& out) {
  out << "usage: dxs <command> [flags]   (dxs <command> --help: that command's flags)\n"
         "commands:\n";
  for (const Command& c : kCommands) {
    out << "  " << c.name << std::string(13 - std::string(c.name).size(), ' ') << c.summary << "\n";
  }
  out << kDeviceNote << kTlsNote;
}

void PrintCommandUsage(const Command& c, std::ostream& out) {
  out << "usage: dxs " << c.name << " [flags]\n" << c.summary << "\nflags:\n" << c.usage;
  if (c.more_usage != nullptr) out << c.more_usage;
}

bool AsksForHelp(const std::vector<std::string>& args) {
  return std::any_of(args.begin(), args.end(),
                     [](const std::string& a) { return a == "--help" || a == "-h"; });
}

}  // namespace

int main(int argc, char** argv) {
  // A bad DXS_* value stops every command here, before it does anything.
  dxs::tunables::ValidateOrDie("dxs");
  if (argc < 2) {
    PrintUsage(std::cerr);
    return 2;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    if (args.empty()) {
      PrintUsage(std::cout);
      return 0;
    }
    const Command* c = Find(args.front());
    if (c == nullptr) {
      std::cerr << "dxs help: unknown command '" << args.front() << "'\n";
      PrintUsage(std::cerr);
      return 2;
    }
    PrintCommandUsage(*c, std::cout);
    return 0;
  }
  const Command* c = Find(cmd);
  if (c == nullptr) {
    std::cerr << "dxs: unknown command '" << cmd << "'\n";
    PrintUsage(std::cerr);
    return 2;
  }
  if (AsksForHelp(args)) {
    PrintCommandUsage(*c, std::cout);
    return 0;
  }
  return c->run(args);
}
