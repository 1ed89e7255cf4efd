// The ModelInfo the router serves from Frontend.GetModelInfo, built from the config.json
// and fingerprint it loads at start-up (every worker must present the same fingerprint, so
// the router's copy describes what the workers serve).
#pragma once

#include <string>

#include "common/model_config.h"
#include "dxs/v1/common.pb.h"

namespace dxs {

// `model_dir` is the checkpoint directory; its base name becomes model_name.
v1::ModelInfo MakeModelInfo(const ModelConfig& config, const std::string& model_dir,
                            const v1::ModelFingerprint& fingerprint);

}  // namespace dxs
