// Must NOT compile: registering an object without state_dict()/load_state_dict() is a
// compile-time error whose message says what is missing (checked by the CTest
// `stateful_compile_error`).
#include <memory>

#include "torchpoint/state_dict.h"

struct NoState {
  int x = 0;
};

int main() {
  torchpoint::AnyStateful any(std::make_shared<NoState>());
  return 0;
}
