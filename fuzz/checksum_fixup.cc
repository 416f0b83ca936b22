#include "checksum_fixup.h"

#include <cstdint>
#include <string_view>

#include "format/checksum.h"
#include "format/container.h"
#include "format/manifest.h"

namespace torchpoint::fuzz {
namespace {

// Sets the 16 digits at `at` to the XXH3 of `bytes` computed with those digits as '0'.
void rewrite_digits(std::string& bytes, std::size_t length, std::size_t at) {
  bytes.replace(at, kChecksumHexLength, kChecksumHexLength, '0');
  bytes.replace(at, kChecksumHexLength, checksum_hex(xxh3(bytes.data(), length)));
}

}  // namespace

void fix_header_checksum(std::string& file) {
  if (file.size() < 8) return;
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(file[i]);
  if (n > file.size() - 8) return;
  std::string_view text = std::string_view(file).substr(8, n);
  std::size_t last = text.find_last_not_of(' ');
  std::string key = "\"" + std::string(kHeaderChecksumKey) + "\":\"";
  std::size_t tail = key.size() + kChecksumHexLength + 3;  // key, digits, "}}
  if (last == std::string_view::npos || last + 1 < tail) return;
  std::size_t key_at = last + 1 - tail;
  if (text.substr(key_at, key.size()) != key || text.substr(last - 2, 3) != "\"}}") return;
  rewrite_digits(file, 8 + n, 8 + key_at + key.size());
}

void fix_manifest_checksum(std::string& manifest) {
  std::string prefix = ",\n  \"" + std::string(kManifestChecksumKey) + "\": \"";
  std::string_view suffix = "\"\n}\n";
  std::size_t tail = prefix.size() + kChecksumHexLength + suffix.size();
  std::string_view bytes = manifest;
  if (bytes.size() < tail || bytes.substr(bytes.size() - tail, prefix.size()) != prefix ||
      !bytes.ends_with(suffix)) {
    return;
  }
  rewrite_digits(manifest, manifest.size(), manifest.size() - suffix.size() - kChecksumHexLength);
}

}  // namespace torchpoint::fuzz
