// Rewrites the self-checksums of fuzz inputs so that mutated bytes get past the checksum check
// and reach the code behind it. Without this, almost every mutation of a header or manifest
// would stop at "checksum mismatch".
#pragma once

#include <string>

namespace torchpoint::fuzz {

// When `file` has a container header that ends with its checksum (docs/format.md), replaces the
// 16 digits with the right ones. Otherwise leaves `file` unchanged.
void fix_header_checksum(std::string& file);

// The same for a manifest.json.
void fix_manifest_checksum(std::string& manifest);

}  // namespace torchpoint::fuzz
