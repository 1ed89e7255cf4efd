// dxs run / gen-model / fingerprint: the single-process tools.
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tunables.h"
#include "model/engine.h"
#include "model/random_checkpoint.h"
#include "model/router_skew_calibration.h"
#include "model/tokenizer_files.h"
#include "nlohmann/json.hpp"
#include "tools/dxs/cli_args.h"
#include "tools/dxs/commands.h"
#include "tools/dxs/sampling_flags.h"

namespace dxs::cli {
namespace {

int Fail(const std::string& cmd, const absl::Status& s) {
  std::cerr << "dxs " << cmd << ": " << s.message() << "\n";
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

// Returns the model directory to use, writing the embedded default when needed.
absl::StatusOr<std::string> ResolveModel(const Args& args) {
  if (args.Has("model")) return args.GetString("model");
  return EnsureDefaultModel();
}

}  // namespace

absl::StatusOr<std::string> EnsureDefaultModel() {
  const std::string dir = DefaultModelDir();
  if (!std::filesystem::exists(dir + "/config.json")) {
    absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
    if (!preset.ok()) return preset.status();
    if (absl::Status s = WriteRandomCheckpoint(*preset, dir); !s.ok()) return s;
  } else if (!HasTokenizerFiles(dir)) {
    // Written before dxs wrote tokenizer files: add them, leaving the weights (and so the
    // fingerprint) as they are. The model runs without them, so a failure only warns.
    absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
    if (!config.ok()) return config.status();
    if (absl::Status s = WriteTokenizerFiles(*config, dir); !s.ok()) {
      std::cerr << "dxs: warning: cannot add the tokenizer files to " << dir << ": " << s.message()
                << "\n";
    }
  }
  return dir;
}

std::string DefaultModelDir() {
  if (const std::string d = tunables::Get(tunables::kCacheDir); !d.empty()) return d + "/default";
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) {
    return std::string(d) + "/dxs/default";
  }
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/dxs/default";
}

int RunCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args =
      Args::Parse(argv,
                  SamplingValueFlags({"model", "prompt-ids", "max-new-tokens", "temperature",
                                      "top-p", "top-k", "seed", "stop-ids", "prefill-chunk",
                                      "format", "device", "preset", "overlap-schedule"}),
                  SamplingBoolFlags({"dump-logits", "ignore-eos", "eager"}));
  if (!args.ok()) return Fail("run", args.status());
  GenerationRequest req;
  auto prompt = args->GetIntList("prompt-ids");
  auto max_new = args->GetInt("max-new-tokens", 16);
  auto temperature = args->GetDouble("temperature", 0.0);
  auto top_p = args->GetDouble("top-p", 1.0);
  auto top_k = args->GetInt("top-k", 0);
  auto seed = args->GetUint("seed", 0);
  auto stop = args->GetIntList("stop-ids");
  auto chunk = args->GetInt("prefill-chunk", 0);
  for (const absl::Status& s :
       {prompt.status(), max_new.status(), temperature.status(), top_p.status(), top_k.status(),
        seed.status(), stop.status(), chunk.status()}) {
    if (!s.ok()) return Fail("run", s);
  }
  const std::string format = args->GetString("format", "text");
  if (format != "text" && format != "json") {
    return Fail("run", absl::InvalidArgumentError("--format must be json or text"));
  }
  if (!args->Has("prompt-ids")) {
    return Fail("run", absl::InvalidArgumentError("--prompt-ids is required (e.g. 1,2,3)"));
  }
  if (*chunk < 0) return Fail("run", absl::InvalidArgumentError("--prefill-chunk must be >= 0"));
  req.prompt = *prompt;
  req.max_new_tokens = *max_new;
  req.sampling.temperature = static_cast<float>(*temperature);
  req.sampling.top_p = static_cast<float>(*top_p);
  req.sampling.top_k = static_cast<int32_t>(*top_k);
  req.sampling.seed = *seed;
  req.stop_token_ids = *stop;
  req.ignore_eos = args->Has("ignore-eos");
  if (absl::Status s = ReadSamplingFlags(*args, format, &req); !s.ok()) return Fail("run", s);

  if (args->Has("preset") && args->Has("model")) {
    return Fail("run", absl::InvalidArgumentError("give --model DIR or --preset NAME, not both"));
  }
  EngineOptions options;
  options.prefill_chunk_tokens = *chunk;
  options.device = args->GetString("device", "cpu");
  options.graphs = !args->Has("eager");
  absl::StatusOr<bool> overlap = args->GetOnOff("overlap-schedule", true);
  if (!overlap.ok()) return Fail("run", overlap.status());
  options.overlap_schedule = *overlap;
  // --preset: the seeded random checkpoint made in place on the device (no disk), e.g. the
  // full qwen3-30b-a3b shape on a GPU.
  absl::StatusOr<std::string> model_dir =
      args->Has("preset") ? absl::StatusOr<std::string>("preset " + args->GetString("preset"))
                          : ResolveModel(*args);
  if (!model_dir.ok()) return Fail("run", model_dir.status());
  absl::StatusOr<std::unique_ptr<LocalEngine>> engine;
  if (args->Has("preset")) {
    absl::StatusOr<CheckpointPreset> preset = GetPreset(args->GetString("preset"));
    if (!preset.ok()) return Fail("run", preset.status());
    engine = LocalEngine::LoadRandom(*preset, options);
  } else {
    engine = LocalEngine::Load(*model_dir, options);
  }
  if (!engine.ok()) return Fail("run", engine.status());
  absl::StatusOr<std::vector<GenerationResult>> results = (*engine)->GenerateBatch({req});
  if (!results.ok()) return Fail("run", results.status());
  const GenerationResult& r = results->front();
  // With --n > 1: every sample, sample 0 (the top-level result) first.
  std::vector<const GenerationResult*> samples;
  if (req.n > 1) {
    samples.push_back(&r);
    for (const GenerationResult& s : r.samples) samples.push_back(&s);
  }
  if (format == "json") {
    nlohmann::json out;
    out["tokens"] = r.tokens;
    out["finish_reason"] = FinishReasonName(r.finish_reason);
    out["model"] = *model_dir;
    if (args->Has("dump-logits")) out["first_logits"] = r.first_logits;
    AddLogprobsJson(req, r.logprobs, r.prompt_logprobs, &out);
    if (!samples.empty()) {
      nlohmann::json list = nlohmann::json::array();
      for (const GenerationResult* s : samples) {
        list.push_back(SampleJson(req, s->tokens, FinishReasonName(s->finish_reason), s->logprobs));
      }
      out["samples"] = list;
    }
    std::cout << out.dump() << "\n";
  } else if (samples.empty()) {
    std::cout << absl::StrJoin(r.tokens, " ") << "\n";
    std::cerr << "finish_reason: " << FinishReasonName(r.finish_reason) << "\n";
  } else {
    // One line per sample, in sample order.
    std::vector<std::string> reasons;
    for (const GenerationResult* s : samples) {
      std::cout << absl::StrJoin(s->tokens, " ") << "\n";
      reasons.push_back(FinishReasonName(s->finish_reason));
    }
    std::cerr << "finish_reason: " << absl::StrJoin(reasons, " ") << "\n";
  }
  return 0;
}

int GenModelCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args =
      Args::Parse(argv, {"out", "preset", "seed", "router-skew", "layers"}, {"in-place", "fp8"});
  if (!args.ok()) return Fail("gen-model", args.status());
  if (!args->Has("out")) {
    return Fail("gen-model", absl::InvalidArgumentError("--out DIR is required"));
  }
  absl::StatusOr<CheckpointPreset> preset = GetPreset(args->GetString("preset", "default"));
  if (!preset.ok()) return Fail("gen-model", preset.status());
  auto seed = args->GetUint("seed", preset->seed);
  if (!seed.ok()) return Fail("gen-model", seed.status());
  preset->seed = *seed;
  if (args->Has("layers")) {
    // The preset's shape with fewer layers (a Qwen3-30B-A3B-shaped model that fits a disk).
    auto layers = args->GetInt("layers", 0);
    if (!layers.ok()) return Fail("gen-model", layers.status());
    if (*layers < 1 || *layers > preset->config.num_hidden_layers) {
      return Fail("gen-model", absl::InvalidArgumentError(absl::StrCat(
                                   "--layers must be in [1, ", preset->config.num_hidden_layers,
                                   "] for preset ", preset->name, ", got ", *layers)));
    }
    preset->config.num_hidden_layers = static_cast<int>(*layers);
  }
  if (args->Has("router-skew")) {
    double skew = 0;
    if (!absl::SimpleAtod(args->GetString("router-skew"), &skew) || !(skew >= 0) || skew > 100) {
      return Fail("gen-model", absl::InvalidArgumentError(
                                   absl::StrCat("--router-skew must be a number in [0, 100], got '",
                                                args->GetString("router-skew"), "'")));
    }
    preset->router_skew = skew;
    if (absl::Status s = CalibrateRouterSkew(&*preset); !s.ok()) return Fail("gen-model", s);
  }
  // --fp8: block-scaled FP8 weights, as the official Qwen3-FP8 checkpoints hold them.
  preset->fp8 = args->Has("fp8");
  const std::string out = args->GetString("out");
  // --in-place: config.json, the recipe and the tokenizer files only; each process makes
  // the weights on its own device when it opens the directory (a full-size shape on a
  // small disk).
  const bool in_place = args->Has("in-place");
  if (absl::Status s =
          in_place ? WriteInPlaceCheckpoint(*preset, out) : WriteRandomCheckpoint(*preset, out);
      !s.ok()) {
    return Fail("gen-model", s);
  }
  absl::StatusOr<std::string> fp = CheckpointFingerprint(out);
  if (!fp.ok()) return Fail("gen-model", fp.status());
  std::cout << "wrote " << (in_place ? "the in-place recipe of preset " : "preset ") << preset->name
            << (preset->fp8 ? " (fp8)" : "") << " to " << out;
  if (preset->router_skew != 0) std::cout << " with router skew " << preset->router_skew;
  std::cout << " (fingerprint " << *fp << ")\n";
  return 0;
}

int FingerprintCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args = Args::Parse(argv, {"model"}, {});
  if (!args.ok()) return Fail("fingerprint", args.status());
  if (!args->Has("model")) {
    return Fail("fingerprint", absl::InvalidArgumentError("--model DIR is required"));
  }
  absl::StatusOr<std::string> fp = CheckpointFingerprint(args->GetString("model"));
  if (!fp.ok()) return Fail("fingerprint", fp.status());
  std::cout << *fp << "\n";
  return 0;
}

}  // namespace dxs::cli
