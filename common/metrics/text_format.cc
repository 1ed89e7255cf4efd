#include "common/metrics/text_format.h"

#include <charconv>
#include <cmath>

namespace dxs::metrics::text {

void AppendEscapedHelp(std::string_view help, std::string* out) {
  for (char c : help) {
    switch (c) {
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      default:
        out->push_back(c);
    }
  }
}

void AppendEscapedLabelValue(std::string_view value, std::string* out) {
  for (char c : value) {
    switch (c) {
      case '\\':
        out->append("\\\\");
        break;
      case '"':
        out->append("\\\"");
        break;
      case '\n':
        out->append("\\n");
        break;
      default:
        out->push_back(c);
    }
  }
}

void AppendValue(double value, std::string* out) {
  if (std::isnan(value)) {
    out->append("NaN");
  } else if (std::isinf(value)) {
    out->append(value > 0 ? "+Inf" : "-Inf");
  } else {
    // Shortest round-trip representation, e.g. 1, 0.25, 1e+06, 1.5e-07.
    char buf[32];
    const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), value);
    out->append(buf, r.ptr);
  }
}

void AppendHeader(std::string_view name, std::string_view help, std::string_view type,
                  std::string* out) {
  out->append("# HELP ").append(name).push_back(' ');
  AppendEscapedHelp(help, out);
  out->append("\n# TYPE ").append(name).push_back(' ');
  out->append(type).push_back('\n');
}

std::string FormatLabels(const std::vector<std::string>& names,
                         const std::vector<std::string>& values) {
  std::string labels;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    if (i > 0) labels.push_back(',');
    labels.append(names[i]).append("=\"");
    AppendEscapedLabelValue(values[i], &labels);
    labels.push_back('"');
  }
  return labels;
}

void AppendSample(std::string_view name, std::string_view labels, std::string_view extra_name,
                  std::string_view extra_value, double value, std::string* out) {
  out->append(name);
  if (!labels.empty() || !extra_name.empty()) {
    out->push_back('{');
    out->append(labels);
    if (!extra_name.empty()) {
      if (!labels.empty()) out->push_back(',');
      out->append(extra_name).append("=\"");
      AppendEscapedLabelValue(extra_value, out);
      out->push_back('"');
    }
    out->push_back('}');
  }
  out->push_back(' ');
  AppendValue(value, out);
  out->push_back('\n');
}

}  // namespace dxs::metrics::text
