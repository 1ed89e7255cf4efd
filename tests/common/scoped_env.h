// ScopedEnv: sets (or, with a null value, unsets) an environment variable for its lifetime;
// UCX reads UCX_* when a transport is created; dxs reads DXS_* (common/tunables.h) when asked.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace dxs::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace dxs::testing
