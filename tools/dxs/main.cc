// dxs: the command-line tool. `dxs help` lists the subcommands.
#include <iostream>
#include <string>
#include <vector>

#include "tools/dxs/commands.h"

namespace {

constexpr char kUsage[] =
    "usage: dxs <command> [flags]\n"
    "commands:\n"
    "  run          generate with the single-process engine\n"
    "               --model DIR (default: the embedded model) --prompt-ids 1,2,3\n"
    "               --max-new-tokens N [--temperature T --top-p P --top-k K --seed S]\n"
    "               [--stop-ids a,b] [--ignore-eos] [--prefill-chunk N] [--dump-logits]\n"
    "               [--format json|text] [--device cpu|cuda[:N]]\n"
    "               [--preset NAME instead of --model: a gen-model preset made in place]\n"
    "               [--eager (no CUDA graphs for decode steps)]\n"
    "  gen-model    write a seeded random checkpoint: --out DIR [--preset default|odd|\n"
    "               bf16-sharded|qwen3-30b-a3b] [--seed S] [--router-skew S (Zipf exponent\n"
    "               of expert popularity; 0: uniform-ish, the weights as drawn)]\n"
    "               [--layers N (the preset's first N layers only)]\n"
    "               [--in-place (config.json and a recipe only: every process that opens\n"
    "               DIR makes the same weights on its own device; a full-size shape on a\n"
    "               small disk)]\n"
    "  fingerprint  print a checkpoint's fingerprint: --model DIR\n"
    "  up           start a local cluster: [--model DIR] --attention M --experts N\n"
    "               [--port P] [--log-dir DIR] [--wire-dtype f32|bf16]\n"
    "               [--overlap-min-tokens N (two-batch overlap from N tokens a step; 0: off)]\n"
    "               [--stream-interval N (tokens per streamed chunk after the first; 1)]\n"
    "               [--piecewise-graphs true|false (GPU decode steps between exchanges as\n"
    "               recorded CUDA graphs; true)]\n"
    "               [--mapped-exchange true|false (rows through the attention rank's memory,\n"
    "               which the expert ranks map: one copy; true)]\n"
    "               [--low-latency-capacity N (GPU decode steps of at most N tokens a DP rank\n"
    "               over the low-latency exchange; 0: off)]\n"
    "               [--device cpu|cuda[:N] (where the workers compute; cpu)]\n"
    "               [--gpus 0,1,... (attention ranks, then expert ranks, on these GPUs\n"
    "               in turn; implies --device cuda)]\n"
    "               [--transport ucx|nccl (the data path's; nccl: GPU memory over one NCCL\n"
    "               communicator, every worker on a GPU; ucx)]\n"
    "               [--num-redundant-experts R (expert replicas; dxs-router's flag)]\n"
    "               [--eplb-interval N (EPLB live: rebalance every N steps)]\n"
    "               [--elastic-ep (dxs-router's flag: lost or drained EP ranks' experts\n"
    "               move to live ranks; an expert worker that dies is started again)];\n"
    "               prints 'listening on ADDR' when healthy,\n"
    "               stops everything on Ctrl-C or SIGTERM\n"
    "  generate     --router ADDR --prompt-ids 1,2,3 [--max-new-tokens N] [sampling flags]\n"
    "               [--dp-rank R] [--format json|text]\n"
    "  status       --router ADDR [--format json]: workers, addresses, loads and the\n"
    "               expert placement (version, experts per EP rank)\n"
    "  rebalance    --router ADDR: one EPLB rebalance now (placement from measured load)\n"
    "  drain        --router ADDR --rank N [--role expert|attention]: stop sending work to\n"
    "               a rank; with dxs-router --elastic-ep an EP rank's experts move off\n"
    "               first, then it exits\n"
    "  bench        --router ADDR | --local MODEL  [--concurrency C --requests R\n"
    "               --prompt-len L --output-len O] [--format json]\n"
    "               [--device cpu|cuda[:N] (with --local)]\n"
    "--device: cpu (default), or a GPU where dxs was built with CUDA; a GPU asked for and\n"
    "  not there is a clear error (exit 1)\n"
    "TLS (up, generate, status, rebalance, bench and the services): --tls-cert FILE --tls-key "
    "FILE\n"
    "  --tls-ca FILE [--mtls]\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (cmd == "run") return dxs::cli::RunCommand(args);
  if (cmd == "gen-model") return dxs::cli::GenModelCommand(args);
  if (cmd == "fingerprint") return dxs::cli::FingerprintCommand(args);
  if (cmd == "up") return dxs::cli::UpCommand(args);
  if (cmd == "generate") return dxs::cli::GenerateCommand(args);
  if (cmd == "status") return dxs::cli::StatusCommand(args);
  if (cmd == "rebalance") return dxs::cli::RebalanceCommand(args);
  if (cmd == "drain") return dxs::cli::DrainCommand(args);
  if (cmd == "bench") return dxs::cli::BenchCommand(args);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    std::cout << kUsage;
    return 0;
  }
  std::cerr << "dxs: unknown command '" << cmd << "'\n" << kUsage;
  return 2;
}
