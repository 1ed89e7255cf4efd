// Pieces of the Prometheus text exposition format, version 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/). Registry::Scrape puts them
// together; they are public so tests can check each rule on its own.
//
//   # HELP name help-with-\\-and-\n-escaped
//   # TYPE name counter|gauge|histogram
//   name{label="value-with-\\-\"-and-\n-escaped",...} value
//
// Values are the shortest decimal text that reads back to the same double (std::to_chars:
// "1", "0.25", "1e+06", "1.5e-07"), or "+Inf", "-Inf", "NaN", all of which the Prometheus
// parser (Go's strconv.ParseFloat) reads exactly. Integers below 2^53 print as integers.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dxs::metrics::text {

// HELP text escapes backslash and newline only (a double quote stays as is: the parser
// rejects \" in HELP).
void AppendEscapedHelp(std::string_view help, std::string* out);
// Label values escape backslash, double quote and newline.
void AppendEscapedLabelValue(std::string_view value, std::string* out);
void AppendValue(double value, std::string* out);

// "# HELP ...\n# TYPE ...\n"
void AppendHeader(std::string_view name, std::string_view help, std::string_view type,
                  std::string* out);

// The inside of the braces for these labels, e.g. role="dp",rank="0"; names and values have
// the same length. Empty when there are no labels.
std::string FormatLabels(const std::vector<std::string>& names,
                         const std::vector<std::string>& values);

// name{labels[,extra_name="extra_value"]} value\n; labels as made by FormatLabels, without
// braces when both labels and extra_name are empty.
void AppendSample(std::string_view name, std::string_view labels, std::string_view extra_name,
                  std::string_view extra_value, double value, std::string* out);

}  // namespace dxs::metrics::text
