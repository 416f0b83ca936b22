// Saves and loads a tensor through an installed torchpoint.
#include <ATen/ops/arange.h>
#include <torchpoint/tensor_file.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::string path = std::string(argv[1]) + "/consumer.safetensors";
  at::Tensor t = at::arange(12, at::TensorOptions().dtype(at::kFloat)).reshape({3, 4});
  torchpoint::save_file(path, {{{"t", t}}, {{"answer", 42}}});
  torchpoint::Container back = torchpoint::load_file(path);
  bool ok =
      back.tensors.size() == 1 && back.tensors[0].second.equal(t) && back.state["answer"] == 42;
  std::printf("consumer: %s\n", ok ? "round trip ok" : "MISMATCH");
  return ok ? 0 : 1;
}
