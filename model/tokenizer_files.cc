#include "model/tokenizer_files.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr char kEndOfText[] = "<|endoftext|>";
constexpr char kImStart[] = "<|im_start|>";
constexpr char kImEnd[] = "<|im_end|>";

// Qwen3's template reduced to what the random models need: one
// <|im_start|>role\ncontent<|im_end|>\n block a message (content as a string or as a list
// of OpenAI text parts), the assistant prompt, and the empty think block of
// enable_thinking=false. Valid for jinja2 and minijinja.
constexpr char kChatTemplate[] =
    R"({%- for message in messages %}
{%- if message['content'] is string %}
{%- set content = message['content'] %}
{%- elif message['content'] is iterable %}
{%- set ns = namespace(text='') %}
{%- for part in message['content'] %}
{%- if part['type'] == 'text' %}{%- set ns.text = ns.text + part['text'] %}{%- endif %}
{%- endfor %}
{%- set content = ns.text %}
{%- else %}
{%- set content = '' %}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %})";

// UTF-8 of a code point below 0x800 (the byte map's code points are below 0x144).
std::string Utf8(uint32_t cp) {
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

// GPT-2's bytes_to_unicode, in its order: the printable bytes stand for themselves, the
// others map to 256, 257, ... Returns (byte, symbol) pairs.
std::vector<std::pair<int, std::string>> ByteSymbols() {
  std::vector<std::pair<int, std::string>> out;
  std::vector<bool> printable(256, false);
  for (int b = 0; b < 256; ++b) {
    printable[b] = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    if (printable[b]) out.emplace_back(b, Utf8(b));
  }
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    if (!printable[b]) out.emplace_back(b, Utf8(next++));
  }
  return out;
}

struct AddedToken {
  int64_t id;
  std::string content;
  bool special;
};

// The vocabulary under construction: id -> token, token -> id, the merges in rank order.
class VocabBuilder {
 public:
  explicit VocabBuilder(int64_t vocab_size) : tokens_(vocab_size) {
    ids_.reserve(static_cast<size_t>(vocab_size) * 2);
  }

  bool Full() const { return next_free_ >= static_cast<int64_t>(tokens_.size()); }
  bool Has(const std::string& token) const { return ids_.count(token) > 0; }
  bool Taken(int64_t id) const { return !tokens_[id].empty(); }

  void Put(int64_t id, const std::string& token) {
    tokens_[id] = token;
    ids_.emplace(token, id);
  }
  // At the lowest free id; the caller checks Full() first.
  void Append(const std::string& token) {
    AdvanceFree();
    Put(next_free_, token);
    AdvanceFree();
  }
  int64_t LowestFree() {
    AdvanceFree();
    return next_free_;
  }
  // Adds the merge a + b if both parts are tokens, the result is new and an id is free.
  bool Merge(const std::string& a, const std::string& b) {
    if (Full() || !Has(a) || !Has(b)) return false;
    std::string merged = a + b;
    if (Has(merged)) return false;
    Append(merged);
    merges_.push_back(a + " " + b);
    return true;
  }

  const std::vector<std::string>& tokens() const { return tokens_; }
  const std::vector<std::string>& merges() const { return merges_; }

 private:
  void AdvanceFree() {
    while (next_free_ < static_cast<int64_t>(tokens_.size()) && Taken(next_free_)) ++next_free_;
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> merges_;
  int64_t next_free_ = 0;
};

// Special tokens at their ids, as the header describes.
std::vector<AddedToken> PlaceAddedTokens(const ModelConfig& c, VocabBuilder* vocab) {
  std::vector<AddedToken> added;
  auto place = [&](int64_t id, const std::string& content, bool special) {
    vocab->Put(id, content);
    added.push_back({id, content, special});
  };
  for (size_t i = 0; i < c.eos_token_ids.size(); ++i) {
    const int64_t id = c.eos_token_ids[i];
    if (vocab->Taken(id)) continue;  // listed twice
    place(id, i == 0 ? std::string(kImEnd) : absl::StrCat("<|eos_", id, "|>"), true);
  }
  if (c.bos_token_id >= 0 && !vocab->Taken(c.bos_token_id)) place(c.bos_token_id, kEndOfText, true);
  // Whatever has no id of its own yet takes the lowest free one.
  for (const auto& [content, special] :
       std::vector<std::pair<std::string, bool>>{{kEndOfText, true},
                                                 {kImEnd, true},
                                                 {kImStart, true},
                                                 {"<think>", false},
                                                 {"</think>", false}}) {
    if (!vocab->Has(content)) place(vocab->LowestFree(), content, special);
  }
  std::sort(added.begin(), added.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.id < b.id; });
  return added;
}

// The merges, in rank order, until the vocabulary is full. The 'Ġ' prefix is the byte
// map's space, 'Ċ' its newline, 'ĉ' its tab.
void AddMerges(VocabBuilder* vocab) {
  const std::string space = Utf8(256 + ' ');
  const std::string newline = Utf8(256 + '\n');
  const std::string tab = Utf8(256 + '\t');
  // English letter frequency order.
  const std::string_view lower = "etaoinsrhldcumfpgwybvkxjqz";
  std::vector<std::string> lowers, uppers;
  for (char ch : lower) {
    lowers.emplace_back(1, ch);
    uppers.emplace_back(1, static_cast<char>(ch - 'a' + 'A'));
  }
  // Letter pairs, the commonest (lowest rank sum) first.
  std::vector<std::pair<int, int>> pairs;
  for (int i = 0; i < 26; ++i) {
    for (int j = 0; j < 26; ++j) pairs.emplace_back(i, j);
  }
  std::stable_sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) {
    return a.first + a.second < b.first + b.second;
  });

  // Tokens made of letters (with or without the space prefix), in creation order: the
  // ones the second phase extends.
  std::vector<std::string> words;
  auto word_merge = [&](const std::string& a, const std::string& b) {
    if (vocab->Merge(a, b)) words.push_back(a + b);
  };
  for (const std::string& l : lowers) word_merge(space, l);
  for (const auto& [i, j] : pairs) word_merge(lowers[i], lowers[j]);
  vocab->Merge(space, space);
  vocab->Merge(newline, newline);
  vocab->Merge(tab, tab);
  for (const std::string& u : uppers) word_merge(space, u);
  for (const auto& [i, j] : pairs) word_merge(uppers[i], lowers[j]);
  for (char a = '0'; a <= '9'; ++a) {
    for (char b = '0'; b <= '9'; ++b) vocab->Merge(std::string(1, a), std::string(1, b));
  }
  for (char d = '0'; d <= '9'; ++d) vocab->Merge(space, std::string(1, d));
  for (int ch = '!'; ch <= '~'; ++ch) {
    if (!std::isalnum(ch)) vocab->Merge(space, std::string(1, static_cast<char>(ch)));
  }
  vocab->Merge(space + space, space + space);
  vocab->Merge(space + space + space + space, space + space + space + space);
  vocab->Merge(newline + newline, newline + newline);
  // Longer words: every word so far extended by each letter, breadth first; the list
  // grows as it is read, so this runs until the vocabulary is full.
  for (size_t w = 0; w < words.size() && !vocab->Full(); ++w) {
    const std::string word = words[w];  // word_merge may reallocate `words`
    for (const std::string& l : lowers) word_merge(word, l);
  }
}

OrderedJson AddedTokenJson(const AddedToken& t, bool with_id) {
  OrderedJson j;
  if (with_id) j["id"] = t.id;
  j["content"] = t.content;
  j["single_word"] = false;
  j["lstrip"] = false;
  j["rstrip"] = false;
  j["normalized"] = false;
  j["special"] = t.special;
  return j;
}

OrderedJson ByteLevelJson() {
  OrderedJson j;
  j["type"] = "ByteLevel";
  j["add_prefix_space"] = false;
  j["trim_offsets"] = true;
  j["use_regex"] = true;
  return j;
}

// tokenizer.json, written by hand around the vocabulary and merges (one a line, in id and
// rank order, as Hugging Face writes them; a json object of 152k keys would be slow).
std::string TokenizerJson(const std::vector<AddedToken>& added, const VocabBuilder& vocab) {
  auto str = [](const std::string& s) { return OrderedJson(s).dump(); };
  OrderedJson added_json = OrderedJson::array();
  for (const AddedToken& t : added) added_json.push_back(AddedTokenJson(t, /*with_id=*/true));
  OrderedJson post = ByteLevelJson();
  post["trim_offsets"] = false;
  std::string out;
  out.reserve(vocab.tokens().size() * 48);
  absl::StrAppend(
      &out, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n",
      "  \"padding\": null,\n  \"added_tokens\": ", added_json.dump(),
      ",\n  \"normalizer\": null,\n  \"pre_tokenizer\": ", ByteLevelJson().dump(),
      ",\n  \"post_processor\": ", post.dump(), ",\n  \"decoder\": ", ByteLevelJson().dump(),
      ",\n  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n",
      "    \"unk_token\": null,\n    \"continuing_subword_prefix\": \"\",\n",
      "    \"end_of_word_suffix\": \"\",\n    \"fuse_unk\": false,\n",
      "    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n", "    \"vocab\": {");
  const std::vector<std::string>& tokens = vocab.tokens();
  for (size_t id = 0; id < tokens.size(); ++id) {
    absl::StrAppend(&out, id == 0 ? "\n      " : ",\n      ", str(tokens[id]), ": ", id);
  }
  absl::StrAppend(&out, "\n    },\n    \"merges\": [");
  const std::vector<std::string>& merges = vocab.merges();
  for (size_t r = 0; r < merges.size(); ++r) {
    absl::StrAppend(&out, r == 0 ? "\n      " : ",\n      ", str(merges[r]));
  }
  absl::StrAppend(&out, merges.empty() ? "]\n  }\n}\n" : "\n    ]\n  }\n}\n");
  return out;
}

std::string TokenizerConfigJson(const ModelConfig& c, const std::vector<AddedToken>& added) {
  OrderedJson j;
  j["add_bos_token"] = false;
  j["add_prefix_space"] = false;
  OrderedJson decoder = OrderedJson::object();
  OrderedJson additional = OrderedJson::array();
  for (const AddedToken& t : added) {
    decoder[std::to_string(t.id)] = AddedTokenJson(t, /*with_id=*/false);
    if (t.special && t.content != kEndOfText) additional.push_back(t.content);
  }
  j["added_tokens_decoder"] = decoder;
  j["additional_special_tokens"] = additional;
  j["bos_token"] = nullptr;  // as Qwen3: nothing is prepended
  j["chat_template"] = kChatTemplate;
  j["clean_up_tokenization_spaces"] = false;
  j["eos_token"] = kImEnd;
  j["errors"] = "replace";
  j["model_max_length"] = c.max_position_embeddings;
  j["pad_token"] = kEndOfText;
  j["split_special_tokens"] = false;
  j["tokenizer_class"] = "Qwen2Tokenizer";
  j["unk_token"] = nullptr;
  return j.dump(2) + "\n";
}

std::string GenerationConfigJson(const ModelConfig& c, const std::vector<AddedToken>& added) {
  OrderedJson j;
  if (c.bos_token_id >= 0) j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_ids;
  for (const AddedToken& t : added) {
    if (t.content == kEndOfText) j["pad_token_id"] = t.id;
  }
  return j.dump(2) + "\n";
}

}  // namespace

absl::StatusOr<TokenizerFiles> MakeTokenizerFiles(const ModelConfig& config) {
  DXS_RETURN_IF_ERROR(config.Validate());
  VocabBuilder vocab(config.vocab_size);
  // At most every eos id, the bos id and five more.
  const int64_t max_added = static_cast<int64_t>(config.eos_token_ids.size()) + 6;
  if (config.vocab_size < max_added + 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size ", config.vocab_size, " cannot hold a byte-level tokenizer (",
                     max_added + 256, " ids: the special tokens and 256 byte symbols)"));
  }
  const std::vector<AddedToken> added = PlaceAddedTokens(config, &vocab);
  for (const auto& [byte, symbol] : ByteSymbols()) vocab.Append(symbol);
  AddMerges(&vocab);
  if (!vocab.Full()) {
    return absl::InternalError(
        absl::StrCat("the tokenizer's merges stopped short of vocab_size ", config.vocab_size));
  }
  TokenizerFiles files;
  files.tokenizer_json = TokenizerJson(added, vocab);
  files.tokenizer_config_json = TokenizerConfigJson(config, added);
  files.generation_config_json = GenerationConfigJson(config, added);
  return files;
}

absl::Status WriteTokenizerFiles(const ModelConfig& config, const std::string& dir) {
  DXS_ASSIGN_OR_RETURN(TokenizerFiles files, MakeTokenizerFiles(config));
  for (const auto& [name, text] :
       {std::pair<const char*, const std::string*>{kTokenizerFile, &files.tokenizer_json},
        {kTokenizerConfigFile, &files.tokenizer_config_json},
        {kGenerationConfigFile, &files.generation_config_json}}) {
    const std::string path = dir + "/" + name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << *text;
    if (!out.good()) return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

bool HasTokenizerFiles(const std::string& dir) {
  std::error_code ec;
  for (const char* name : {kTokenizerFile, kTokenizerConfigFile, kGenerationConfigFile}) {
    if (!std::filesystem::exists(dir + "/" + name, ec)) return false;
  }
  return true;
}

}  // namespace dxs
