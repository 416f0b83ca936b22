// Must NOT compile: register_for_checkpointing of an object without
// state_dict()/load_state_dict() (checked by the CTest `register_compile_error`).
#include "torchpoint/accelerator.h"

struct NoState {
  int x = 0;
};

int main() {
  torchpoint::Accelerator accelerator;
  NoState object;
  accelerator.register_for_checkpointing(object);
  return 0;
}
