// Accelerate users' own loops, written as Accelerate's guide and examples write them in Python,
// each interrupted at every checkpoint and resumed: the resumed run must see exactly the
// batches, and end with exactly the weights, of the run that was never interrupted.
//
// The two resume patterns of Accelerate's examples (examples/complete_nlp_example.py):
//   step_N:  starting_epoch = N / len(loader), resume_step = N % len(loader); the first epoch
//            skips resume_step batches with skip_first_batches (also when it is 0);
//   epoch_N: starting_epoch = N + 1, no skipping.
#include <torch/torch.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "testing/test_util.h"
#include "tests/state_digest.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/data_loader.h"
#include "torchpoint/error.h"
#include "torchpoint/grad_scaler.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"

namespace torchpoint {
namespace {

using testing::TempDir;

constexpr std::size_t kSamples = 22;  // with batches of 4: 6 batches, the last one partial
constexpr std::size_t kBatch = 4;
constexpr int kEpochs = 3;

// Sample i is the number i, so a batch says which samples it holds.
struct Numbers : torch::data::datasets::Dataset<Numbers> {
  torch::data::Example<> get(std::size_t i) override {
    auto v = torch::full({1}, static_cast<float>(i));
    return {v, v * 0.5};
  }
  c10::optional<std::size_t> size() const override { return kSamples; }
};

using Loader = ResumableDataLoader<
    torch::data::datasets::MapDataset<Numbers, torch::data::transforms::Stack<>>>;

// What a run saw and where it ended.
struct Run {
  std::vector<std::vector<int>> batches;  // sample numbers of every batch trained on
  std::vector<std::string> checkpoints;   // in the order saved
  at::Tensor weight;
};

enum class Pattern { Step, Epoch };

// One run of the user's loop. With `resume`, it first loads that checkpoint and computes where
// to start as the user's code does, from the checkpoint's name.
Run run_loop(const std::string& project, Pattern pattern, bool drop_last,
             const std::optional<std::string>& resume = std::nullopt) {
  Accelerator acc(ProjectConfiguration().project_dir(project));
  torch::manual_seed(3);
  torch::nn::Linear model(1, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto loader = make_resumable_data_loader(
      Numbers().map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(kBatch).drop_last(drop_last), /*shuffle=*/true,
      /*seed=*/11);
  acc.prepare(model, optimizer, loader);

  int starting_epoch = 0;
  std::optional<std::size_t> resume_step;
  std::int64_t completed_steps = 0;
  if (resume) {
    acc.load_state(project + "/" + *resume);
    const std::size_t per_epoch = loader->batches_per_epoch();
    if (resume->starts_with("epoch_")) {
      starting_epoch = std::stoi(resume->substr(6)) + 1;
      completed_steps = starting_epoch * static_cast<std::int64_t>(per_epoch);
    } else {
      completed_steps = std::stoll(resume->substr(5));
      starting_epoch = static_cast<int>(completed_steps / static_cast<std::int64_t>(per_epoch));
      resume_step = static_cast<std::size_t>(completed_steps) -
                    static_cast<std::size_t>(starting_epoch) * per_epoch;
    }
  }

  Run run;
  for (int epoch = starting_epoch; epoch < kEpochs; ++epoch) {
    std::shared_ptr<Loader> active = loader;
    if (resume && epoch == starting_epoch && resume_step.has_value()) {
      active = acc.skip_first_batches(loader, *resume_step);
    }
    for (auto& batch : *active) {
      std::vector<int> numbers;
      for (std::int64_t i = 0; i < batch.data.size(0); ++i) {
        numbers.push_back(static_cast<int>(batch.data[i][0].item<float>()));
      }
      run.batches.push_back(numbers);
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
      acc.backward(loss);
      optimizer.step();
      ++completed_steps;
      if (pattern == Pattern::Step) {
        std::string name = "step_" + std::to_string(completed_steps);
        acc.save_state(project + "/" + name);
        run.checkpoints.push_back(name);
      }
    }
    if (pattern == Pattern::Epoch) {
      std::string name = "epoch_" + std::to_string(epoch);
      acc.save_state(project + "/" + name);
      run.checkpoints.push_back(name);
    }
  }
  run.weight = model->weight.detach().clone();
  return run;
}

void expect_resumes_exactly(Pattern pattern, bool drop_last) {
  TempDir dir;
  const std::string project = dir / "run";
  Run whole = run_loop(project, pattern, drop_last);
  ASSERT_FALSE(whole.checkpoints.empty());
  // Each checkpoint's position in the uninterrupted run, in batches.
  std::size_t per_epoch = drop_last ? kSamples / kBatch : (kSamples + kBatch - 1) / kBatch;
  for (std::size_t c = 0; c < whole.checkpoints.size(); ++c) {
    const std::string& name = whole.checkpoints[c];
    SCOPED_TRACE(name);
    std::size_t done = pattern == Pattern::Step ? c + 1 : (c + 1) * per_epoch;
    // A fresh project holding only that checkpoint, as after a crash right after it was saved.
    TempDir copy_dir;
    const std::string copy = copy_dir / "run";
    std::filesystem::create_directories(copy);
    std::filesystem::copy(project + "/" + name, copy + "/" + name,
                          std::filesystem::copy_options::recursive);
    Run resumed = run_loop(copy, pattern, drop_last, name);
    std::vector<std::vector<int>> expected(
        whole.batches.begin() + static_cast<std::ptrdiff_t>(done), whole.batches.end());
    ASSERT_EQ(resumed.batches, expected) << "the resumed run saw other batches";
    EXPECT_TRUE(testing::bitwise_equal(resumed.weight, whole.weight));
  }
}

// Accelerate's step_N pattern, a checkpoint after every step: including those taken at the last
// batch of an epoch, where resume_step is 0 (before, that replayed the finished epoch).
TEST(AccelerateLoops, StepCheckpointsResumeExactly) {
  expect_resumes_exactly(Pattern::Step, /*drop_last=*/false);
}
TEST(AccelerateLoops, StepCheckpointsResumeExactlyWithDropLast) {
  expect_resumes_exactly(Pattern::Step, /*drop_last=*/true);
}

// Accelerate's epoch_N pattern: saved after the epoch's loop, resumed at the next epoch (before,
// the first resumed epoch was empty and every later one shifted by one).
TEST(AccelerateLoops, EpochCheckpointsResumeExactly) {
  expect_resumes_exactly(Pattern::Epoch, /*drop_last=*/false);
}

// Accelerate's gradient accumulation loop (accumulate(model), gradient_accumulation_steps=4),
// three epochs of 6 batches: it steps on every 4th batch and on every epoch's last (which starts
// the count again), like a hand-written loop that sums loss / 4 and steps at the same batches,
// bit for bit; it saves at every step, each checkpoint resumes to the same end; a save on a
// batch that does not step is refused and writes nothing.
struct AccumulationRun {
  std::vector<int> stepped_at;  // the batches (counted over the run from 1) that stepped
  std::vector<std::string> checkpoints;
  at::Tensor weight;
};

AccumulationRun accumulation_loop(const std::string& project, bool use_accumulate,
                                  const std::optional<std::string>& resume = std::nullopt,
                                  int save_at_batch = -1) {
  Accelerator acc(ProjectConfiguration().project_dir(project).automatic_checkpoint_naming(true));
  torch::manual_seed(3);
  torch::nn::Linear model(1, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.001));
  auto loader = make_resumable_data_loader(Numbers().map(torch::data::transforms::Stack<>()),
                                           torch::data::DataLoaderOptions().batch_size(kBatch),
                                           /*shuffle=*/true, /*seed=*/11);
  acc.prepare(model, optimizer, loader);
  if (use_accumulate) acc.set_gradient_accumulation_steps(4);
  if (resume) acc.load_state(*resume);
  AccumulationRun run;
  // Batches of the run before this one: whole epochs of 6, and the restored epoch's part.
  int batch_number = 0;
  if (resume) {
    batch_number = static_cast<int>(loader->sampler().epoch()) * 6 +
                   static_cast<int>((loader->sampler().samples_consumed() + kBatch - 1) / kBatch);
  }
  for (auto epoch = loader->sampler().next_epoch(); epoch < kEpochs; ++epoch) {
    int in_epoch = 0;
    for (auto& batch : *loader) {
      ++batch_number;
      ++in_epoch;
      auto loss = [&] { return torch::mse_loss(model->forward(batch.data), batch.target); };
      if (use_accumulate) {
        auto accumulating = acc.accumulate();
        acc.backward(loss());
        if (batch_number == save_at_batch) acc.save_state();  // refused: does not step
        if (acc.optimizer_step(optimizer)) run.stepped_at.push_back(batch_number);
        if (acc.sync_gradients()) {
          optimizer.zero_grad();
          run.checkpoints.push_back(acc.save_state());
        }
      } else {
        (loss() / 4).backward();
        if (in_epoch % 4 == 0 || in_epoch == 6) {
          optimizer.step();
          optimizer.zero_grad();
          run.stepped_at.push_back(batch_number);
        }
      }
    }
  }
  run.weight = model->weight.detach().clone();
  return run;
}

TEST(AccelerateLoops, GradientAccumulationStepsEveryNthBatchAndAtTheEpochsEnd) {
  TempDir dir;
  AccumulationRun by_hand = accumulation_loop(dir / "by_hand", /*use_accumulate=*/false);
  AccumulationRun whole = accumulation_loop(dir / "run", /*use_accumulate=*/true);
  EXPECT_EQ(whole.stepped_at, (std::vector<int>{4, 6, 10, 12, 16, 18}));
  EXPECT_EQ(whole.stepped_at, by_hand.stepped_at);
  EXPECT_TRUE(testing::bitwise_equal(whole.weight, by_hand.weight));
  ASSERT_EQ(whole.checkpoints.size(), 6u);
  for (std::size_t c = 0; c + 1 < whole.checkpoints.size(); ++c) {
    SCOPED_TRACE(whole.checkpoints[c]);
    TempDir copy_dir;
    const std::string copy = copy_dir / "run";
    const std::string name = std::filesystem::path(whole.checkpoints[c]).filename();
    std::filesystem::create_directories(copy + "/checkpoints");
    std::filesystem::copy(whole.checkpoints[c], copy + "/checkpoints/" + name,
                          std::filesystem::copy_options::recursive);
    AccumulationRun resumed =
        accumulation_loop(copy, /*use_accumulate=*/true, copy + "/checkpoints/" + name);
    std::vector<int> expected(whole.stepped_at.begin() + static_cast<std::ptrdiff_t>(c) + 1,
                              whole.stepped_at.end());
    EXPECT_EQ(resumed.stepped_at, expected);
    EXPECT_TRUE(testing::bitwise_equal(resumed.weight, whole.weight));
  }
  TempDir refused;
  testing::expect_error(
      [&] { accumulation_loop(refused / "run", /*use_accumulate=*/true, std::nullopt, 7); },
      ErrorCode::InvalidArgument, {"save_state()", "gradient accumulation", "sync_gradients()"});
  // The refused save at batch 7 left the checkpoints of the steps at batches 4 and 6 alone.
  std::vector<std::string> names;
  for (const std::string& name : testing::list_sorted(refused / "run/checkpoints")) {
    if (name != ".lock") names.push_back(name);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_0", "checkpoint_1"}));
}

// Accumulating by hand with no_sync(): a save between an unsynchronized backward() and the
// step is refused, like the accumulate() one; after the step it is fine.
TEST(AccelerateLoops, SaveAfterABackwardUnderNoSyncIsRefused) {
  TempDir dir;
  Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  acc.prepare(model, optimizer);
  auto x = torch::randn({8, 3});
  {
    auto local = acc.no_sync();
    acc.backward(model->forward(x).pow(2).mean());
  }
  testing::expect_error([&] { acc.save_state(dir / "bad"); }, ErrorCode::InvalidArgument,
                        {"save_state()", "no_sync()"});
  EXPECT_FALSE(std::filesystem::exists(dir / "bad"));
  acc.backward(model->forward(x).pow(2).mean());
  EXPECT_TRUE(acc.optimizer_step(optimizer));
  EXPECT_EQ(acc.save_state(dir / "ok"), dir / "ok");
  testing::expect_error([&] { acc.set_gradient_accumulation_steps(0); }, ErrorCode::InvalidArgument,
                        {"at least 1"});
}

// prepare() gives back what it was given, with its own type: a user's module class behind a
// shared_ptr, a TORCH_MODULE holder and LibTorch's own holders, so the loop calls forward().
struct NetImpl : torch::nn::Module {
  NetImpl() : fc(register_module("fc", torch::nn::Linear(3, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return fc->forward(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

TEST(AccelerateLoops, PrepareKeepsTheTypesOfModules) {
  TempDir dir;
  Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
  auto shared = acc.prepare(std::make_shared<NetImpl>());
  static_assert(std::is_same_v<decltype(shared), std::shared_ptr<NetImpl>>);
  Net holder;
  torch::optim::SGD optimizer(holder->parameters(), torch::optim::SGDOptions(0.1));
  auto [net, opt, linear] = acc.prepare(holder, optimizer, torch::nn::Linear(2, 2));
  static_assert(std::is_same_v<decltype(net), Net>);
  static_assert(std::is_same_v<decltype(opt), AcceleratedOptimizer<torch::optim::SGD>&>);
  static_assert(std::is_same_v<decltype(acc.prepare(std::make_shared<torch::optim::Adam>(
                                   holder->parameters()))),
                               std::shared_ptr<AcceleratedOptimizer<torch::optim::Adam>>>);
  // The wrapper converts to the optimizer: LibTorch's schedulers and functions take it.
  torch::optim::SGD& raw = opt;
  EXPECT_EQ(&raw, &optimizer);
  EXPECT_EQ(&opt.base(), &optimizer);
  EXPECT_EQ(opt->param_groups().size(), 1u);
  static_assert(std::is_same_v<decltype(linear), torch::nn::Linear>);
  auto x = torch::ones({4, 3});
  EXPECT_EQ(shared->forward(x).sizes(), (std::vector<std::int64_t>{4, 1}));
  EXPECT_EQ(net->forward(x).sizes(), (std::vector<std::int64_t>{4, 1}));
  // All three are checkpointed: model, model_1, model_2.
  const std::string saved = acc.save_state(dir / "ckpt");
  for (const char* file : {"model.safetensors", "model_1.safetensors", "model_2.safetensors"}) {
    EXPECT_TRUE(std::filesystem::exists(saved + "/" + file)) << file;
  }
}

// register_for_checkpointing takes what Accelerate's takes: modules (a holder, a shared_ptr to
// a module class) and optimizers (by reference or shared_ptr), saved as custom_checkpoint_<i>
// and restored bit for bit by load_state, like the prepared ones.
TEST(AccelerateLoops, ModulesAndOptimizersRegisterAsInAccelerate) {
  TempDir dir;
  torch::manual_seed(7);
  torch::nn::Linear model(3, 1), ema(3, 1);
  auto extra = std::make_shared<NetImpl>();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::Adam second(ema->parameters(), torch::optim::AdamOptions(0.01));
  auto third =
      std::make_shared<torch::optim::SGD>(extra->parameters(), torch::optim::SGDOptions(0.1));
  Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
  acc.prepare(model, optimizer);
  acc.register_for_checkpointing(ema, second, extra, third);
  auto x = torch::randn({8, 3});
  auto step_all = [&] {
    for (torch::optim::Optimizer* o : std::vector<torch::optim::Optimizer*>{&optimizer, &second,
                                                                            third.get()}) {
      o->zero_grad();
    }
    acc.backward(model->forward(x).pow(2).mean() + ema->forward(x).pow(2).mean() +
                 extra->forward(x).pow(2).mean());
    optimizer.step();
    second.step();
    third->step();
  };
  step_all();
  auto digest = [&] {
    StateDict sd;
    sd.set_child("ema", module_state_dict(*ema));
    sd.set_child("extra", module_state_dict(*extra));
    sd.set_child("second", optimizer_state_dict(second));
    sd.set_child("third", optimizer_state_dict(*third));
    return testing::state_digest(sd);
  };
  const auto saved_digest = digest();
  const std::string saved = acc.save_state(dir / "ckpt");
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(std::filesystem::exists(saved + "/custom_checkpoint_" + std::to_string(i) +
                                        ".safetensors"))
        << i;
  }
  step_all();
  step_all();
  ASSERT_NE(digest(), saved_digest) << "the steps changed the registered objects";
  acc.load_state(saved);
  EXPECT_EQ(digest(), saved_digest) << "every registered module and optimizer came back";
}

// The hooks' handles, as in Accelerate's test_save_load_model_with_hooks: registered hooks run
// at each save and load, in order; after remove() they no longer do, and the other hooks still
// run. Removing twice, or after the Accelerator is gone, does nothing.
TEST(AccelerateLoops, HooksStopRunningOnceTheirHandlesRemoveThem) {
  TempDir dir;
  std::vector<std::string> ran;
  RemovableHandle kept_past_the_accelerator;
  {
    Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
    torch::nn::Linear model(3, 1);
    acc.prepare(model);
    RemovableHandle save_a =
        acc.register_save_state_pre_hook([&](const std::string&) { ran.push_back("save a"); });
    RemovableHandle save_b =
        acc.register_save_state_pre_hook([&](const std::string&) { ran.push_back("save b"); });
    RemovableHandle load =
        acc.register_load_state_pre_hook([&](const std::string&) { ran.push_back("load"); });
    const std::string first = acc.save_state(dir / "first");
    acc.load_state(first);
    EXPECT_EQ(ran, (std::vector<std::string>{"save a", "save b", "load"}));
    ran.clear();
    save_a.remove();
    load.remove();
    load.remove();  // a second remove() does nothing
    acc.load_state(acc.save_state(dir / "second"));
    EXPECT_EQ(ran, (std::vector<std::string>{"save b"}));
    kept_past_the_accelerator = save_b;
  }
  kept_past_the_accelerator.remove();  // the Accelerator is gone: nothing to do, no crash
}

// LibTorch's own torch::optim::StepLR, prepared as Accelerate users prepare their scheduler,
// comes back exactly: a run saved after epoch 3 and resumed gives every later learning rate and
// weight of the uninterrupted run (the step count, protected in LibTorch, is what it needs).
// Accelerate's test_save_load_model_with_hooks, with its hooks' signatures: the save hook gets
// the prepared models, their states about to be written and the directory, and writes a config
// there; the load hook gets the models and the directory and reads it back. The weights come
// back from the checkpoint, and the config file is part of it.
TEST(AccelerateLoops, HooksGetTheModelsAndTheirWeightsAsInAccelerate) {
  TempDir dir;
  torch::manual_seed(11);
  torch::nn::Linear model(3, 2);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
  acc.prepare(model, sgd);
  const at::Tensor signature = model->weight.clone();
  std::string loaded_class;
  auto save_hook = acc.register_save_state_pre_hook(
      [&](Accelerator::ModelList& models, std::vector<StateDict>& weights,
          const std::string& output_dir) {
        ASSERT_EQ(models.size(), 1u);
        EXPECT_EQ(models[0].get(), model.ptr().get()) << "the prepared model itself";
        ASSERT_EQ(weights.size(), 1u);
        EXPECT_EQ(weights[0].keys(), (std::vector<std::string>{"weight", "bias"}));
        EXPECT_TRUE(testing::bitwise_equal(weights[0].tensor("weight"), model->weight));
        write_file_atomically(Env::posix(), output_dir + "/data.json",
                              Json{{"class_name", models[0]->name()}}.dump());
      });
  auto load_hook = acc.register_load_state_pre_hook(
      [&](Accelerator::ModelList& models, const std::string& input_dir) {
        ASSERT_EQ(models.size(), 1u);
        EXPECT_EQ(models[0].get(), model.ptr().get());
        loaded_class = Json::parse(testing::read_bytes(input_dir + "/data.json"))["class_name"];
      });
  const std::string first = acc.save_state(dir / "first");
  torch::NoGradGuard no_grad;
  model->weight.uniform_();
  ASSERT_FALSE(testing::bitwise_equal(model->weight, signature));
  acc.load_state(first);
  EXPECT_TRUE(testing::bitwise_equal(model->weight, signature));
  EXPECT_EQ(loaded_class, "torch::nn::LinearImpl");
  // Removed, they no longer run: no config in the next checkpoint, nothing read.
  save_hook.remove();
  load_hook.remove();
  loaded_class.clear();
  const std::string second = acc.save_state(dir / "second");
  EXPECT_FALSE(std::filesystem::exists(second + "/data.json"));
  model->weight.uniform_();
  acc.load_state(second);
  EXPECT_TRUE(testing::bitwise_equal(model->weight, signature));
  EXPECT_EQ(loaded_class, "");
}

// The shape of diffusers' training scripts on Accelerate: the save hook saves one model its own
// way and takes its state out of `weights`, so the checkpoint does not hold it twice; the load
// hook loads it and takes it out of `models`. Both models come back bit for bit. A hook that
// changes an entry changes what is written. Without the load hook the load fails, naming the
// model state the checkpoint lacks; an asynchronous save refuses a hook that takes the weights.
TEST(AccelerateLoops, AModelAHookSavesItselfIsNotWrittenTwice) {
  TempDir dir;
  torch::manual_seed(12);
  torch::nn::Linear backbone(4, 3), head(3, 1);
  Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
  acc.prepare(backbone, head);
  auto saving = acc.register_save_state_pre_hook(
      [](Accelerator::ModelList& models, std::vector<StateDict>& weights, const std::string& dir) {
        torch::save(models.back(), dir + "/head.pt");
        weights.pop_back();
      });
  auto loading = acc.register_load_state_pre_hook(
      [](Accelerator::ModelList& models, const std::string& dir) {
        torch::load(models.back(), dir + "/head.pt");
        models.pop_back();
      });
  const at::Tensor backbone_weight = backbone->weight.clone(), head_weight = head->weight.clone();
  const std::string saved = acc.save_state(dir / "ckpt");
  EXPECT_TRUE(std::filesystem::exists(saved + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(saved + "/model_1.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(saved + "/head.pt"));
  {
    torch::NoGradGuard no_grad;
    backbone->weight.uniform_();
    head->weight.uniform_();
  }
  LoadStateReport report = acc.load_state(saved);
  EXPECT_TRUE(testing::bitwise_equal(backbone->weight, backbone_weight));
  EXPECT_TRUE(testing::bitwise_equal(head->weight, head_weight)) << "the hook's own load";
  EXPECT_EQ(report.components, (std::vector<std::string>{"model", "random_states_0"}));

  loading.remove();
  testing::expect_error([&] { acc.load_state(saved); }, ErrorCode::Incompatible, {"model_1"});
  EXPECT_TRUE(testing::bitwise_equal(backbone->weight, backbone_weight))
      << "a failed load changes nothing";

  saving.remove();
  acc.register_save_state_pre_hook(
      [](Accelerator::ModelList&, std::vector<StateDict>& weights, const std::string&) {
        weights[1].set("bias", torch::full({1}, 7.0f));
      });
  const std::string changed = acc.save_state(dir / "changed");
  acc.load_state(changed);
  EXPECT_EQ(head->bias.item<float>(), 7.0f) << "the hook's entry was written";
  EXPECT_TRUE(testing::bitwise_equal(head->weight, head_weight));
  testing::expect_error([&] { acc.save_state_async(dir / "async"); }, ErrorCode::Unsupported,
                        {"save_state_async()", "weights", "save_state()"});
}

TEST(AccelerateLoops, LibTorchStepLRResumesExactly) {
  constexpr int kEpochs = 7;
  auto run = [](const std::string& dir, int from, int save_at) {
    Accelerator acc(ProjectConfiguration().project_dir(dir));
    torch::manual_seed(5);
    torch::nn::Linear model(3, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::StepLR scheduler(optimizer, /*step_size=*/2, /*gamma=*/0.5);
    auto [m, o, s] = acc.prepare(model, optimizer, scheduler);
    static_assert(std::is_same_v<decltype(s), torch::optim::StepLR&>);
    if (from > 0) acc.load_state(dir + "/epoch_" + std::to_string(from - 1));
    std::vector<double> lrs;
    auto x = torch::ones({4, 3});
    for (int epoch = from; epoch < kEpochs; ++epoch) {
      optimizer.zero_grad();
      acc.backward(model->forward(x).pow(2).mean());
      optimizer.step();
      scheduler.step();
      lrs.push_back(optimizer.param_groups()[0].options().get_lr());
      if (epoch == save_at) acc.save_state(dir + "/epoch_" + std::to_string(epoch));
    }
    return std::make_pair(lrs, model->weight.detach().clone());
  };
  TempDir dir;
  auto [whole_lrs, whole_weight] = run(dir.path(), 0, /*save_at=*/3);
  auto [resumed_lrs, resumed_weight] = run(dir.path(), 4, /*save_at=*/-1);
  EXPECT_EQ(resumed_lrs, std::vector<double>(whole_lrs.begin() + 4, whole_lrs.end()));
  EXPECT_TRUE(testing::bitwise_equal(resumed_weight, whole_weight));
  EXPECT_EQ(whole_lrs.back(), 0.1 * 0.125) << "the schedule did decay";

  // Its options are recorded too: LibTorch cannot change them, so a StepLR built with others
  // is refused, naming both, rather than continue another schedule.
  Accelerator acc;
  torch::nn::Linear model(3, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::StepLR other(optimizer, /*step_size=*/3, /*gamma=*/0.5);
  acc.prepare(model, optimizer, other);
  testing::expect_error([&] { acc.load_state(dir.path() + "/epoch_3"); }, ErrorCode::Incompatible,
                        {"StepLR(step_size 2, gamma 0.5)", "this one has step_size 3, gamma 0.5",
                         "cannot change"});
}

// The guide's loop with a GradScaler prepared: acc.backward(loss) scales the loss, so a plain
// optimizer.step() would step on scaled gradients. That step is caught at the next backward()
// or save_state(), which throw naming optimizer_step(), so it never reaches a checkpoint.
// Gradient accumulation (several backward() calls per step) is not mistaken for it, and the
// loop with acc.optimizer_step() runs clean (the control).
TEST(AccelerateLoops, StepOnScaledGradientsFailsLoudly) {
  for (bool through_accelerator : {false, true}) {
    SCOPED_TRACE(through_accelerator ? "acc.optimizer_step" : "optimizer.step");
    TempDir dir;
    Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
    torch::nn::Linear model(3, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    GradScaler scaler(GradScalerOptions().init_scale(1024));
    acc.prepare(model, optimizer, scaler);
    auto x = torch::randn({8, 3});
    auto step = [&] {
      optimizer.zero_grad();
      for (int micro = 0; micro < 2; ++micro) {  // accumulation: two backward() per step
        acc.backward(model->forward(x).pow(2).mean());
      }
      if (through_accelerator) {
        acc.optimizer_step(optimizer);
      } else {
        optimizer.step();
      }
    };
    step();
    if (through_accelerator) {
      step();
      EXPECT_EQ(acc.save_state(dir / "ok"), dir / "ok");
    } else {
      testing::expect_error([&] { acc.save_state(dir / "bad"); }, ErrorCode::InvalidArgument,
                            {"save_state()", "optimizer.step()", "acc.optimizer_step(optimizer)"});
      EXPECT_FALSE(std::filesystem::exists(dir / "bad")) << "the bad step reached a checkpoint";
      // The next step's first backward() finds the scaled gradients cleared, unconsumed.
      testing::expect_error([&] { step(); }, ErrorCode::InvalidArgument, {"backward()"});
      testing::expect_error([&] { acc.save_state(dir / "bad"); }, ErrorCode::InvalidArgument);
    }
  }
}

// The loop of Accelerate's guide with a GradScaler, as written: optimizer.step() on the object
// prepare() returned unscales, skips the step whose gradients overflowed (step_was_skipped(), as
// in Accelerate's test of it) and updates the scale. A reference loop written against the
// GradScaler directly gives the same weights, gradients and scales, bit for bit.
TEST(AccelerateLoops, TheGuidesLoopWithAScalerIsCorrectAsWritten) {
  auto run = [](bool through_wrapper) {
    torch::manual_seed(5);
    torch::nn::Linear model(3, 2);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    GradScaler scaler(GradScalerOptions().growth_interval(2));  // 65536, as PyTorch's
    TempDir dir;
    Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
    auto [net, optimizer] = acc.prepare(model, sgd);
    acc.prepare(scaler);
    auto x = torch::randn({16, 3});
    std::vector<double> scales;
    std::vector<bool> skipped;
    double largest_gradient = 0;
    for (int i = 0; i < 6; ++i) {
      // Iteration 2's loss overflows, so its step is skipped and the scale backs off.
      auto loss = net->forward(x).pow(2).mean() * (i == 2 ? 1e38 : 1.0);
      if (through_wrapper) {
        optimizer.zero_grad();
        acc.backward(loss);
        optimizer.step();
        skipped.push_back(optimizer.step_was_skipped());
      } else {
        sgd.zero_grad();
        scaler.scale(loss).backward();
        skipped.push_back(!scaler.step(sgd));
        scaler.update();
      }
      if (i != 2) {
        largest_gradient =
            std::max(largest_gradient, model->weight.grad().abs().max().item<double>());
      }
      scales.push_back(scaler.get_scale());
    }
    if (through_wrapper) {
      EXPECT_EQ(acc.save_state(dir / "ok"), dir / "ok") << "no scaled gradient left unconsumed";
    }
    return std::make_tuple(scales, skipped, largest_gradient, model->weight.clone(),
                           model->weight.grad().clone());
  };
  auto [want_scales, want_skipped, want_largest, want_weight, want_grad] = run(false);
  auto [scales, skipped, largest, weight, grad] = run(true);
  EXPECT_EQ(skipped, (std::vector<bool>{false, false, true, false, false, false}));
  EXPECT_EQ(skipped, want_skipped);
  EXPECT_EQ(scales, want_scales);
  EXPECT_EQ(want_scales, (std::vector<double>{65536, 131072, 65536, 65536, 131072, 131072}));
  EXPECT_LT(largest, 100.0) << "the optimizer saw gradients still multiplied by the scale";
  EXPECT_EQ(largest, want_largest);
  EXPECT_TRUE(testing::bitwise_equal(weight, want_weight));
  EXPECT_TRUE(testing::bitwise_equal(grad, want_grad));
}

// Accumulation as Accelerate's test of accumulate(): the loop calls optimizer.step() and
// optimizer.zero_grad() on every iteration; the prepared optimizer steps and clears on every
// second one only. The same run written the documented long way (acc.optimizer_step, zero only
// when sync_gradients()) ends bit for bit alike, and the weights change on stepping iterations
// only.
TEST(AccelerateLoops, ThePreparedOptimizerStepsAndClearsOnlyWhenSynchronizing) {
  auto run = [](bool through_wrapper) {
    torch::manual_seed(6);
    torch::nn::Linear model(3, 1);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    TempDir dir;
    Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
    acc.set_gradient_accumulation_steps(2);
    auto& optimizer = acc.prepare(adam);
    acc.prepare(model);
    std::vector<bool> changed;
    for (int i = 0; i < 6; ++i) {
      auto before = model->weight.clone();
      auto accumulating = acc.accumulate();
      acc.backward(model->forward(torch::full({4, 3}, 0.1 * (i + 1))).pow(2).mean());
      if (through_wrapper) {
        EXPECT_EQ(optimizer.step(), i % 2 == 1) << i;
        EXPECT_FALSE(optimizer.step_was_skipped());
        optimizer.zero_grad();
      } else {
        acc.optimizer_step(adam);
        if (acc.sync_gradients()) adam.zero_grad();
      }
      changed.push_back(!testing::bitwise_equal(model->weight, before));
    }
    return std::make_pair(changed, model->weight.clone());
  };
  auto [want_changed, want_weight] = run(false);
  auto [changed, weight] = run(true);
  EXPECT_EQ(changed, (std::vector<bool>{false, true, false, true, false, true}));
  EXPECT_EQ(changed, want_changed);
  EXPECT_TRUE(testing::bitwise_equal(weight, want_weight));
}

// clip_grad_norm_ and clip_grad_value_ as Accelerate's: with a GradScaler they unscale first
// (the norm returned is the true one), and the step does not unscale again; the reference
// written against PyTorch's recipe (unscale_, clip, step, update) agrees bit for bit. On an
// accumulating iteration with a scaler, clipping is refused with a message that says when to clip.
TEST(AccelerateLoops, ClippingUnscalesFirstAsAccelerateDoes) {
  for (bool by_value : {false, true}) {
    SCOPED_TRACE(by_value ? "clip_grad_value_" : "clip_grad_norm_");
    auto run = [by_value](bool through_accelerator) {
      torch::manual_seed(8);
      torch::nn::Linear model(3, 2);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
      GradScaler scaler(GradScalerOptions().init_scale(4096));
      TempDir dir;
      Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
      auto& optimizer = acc.prepare(sgd);
      acc.prepare(model, scaler);
      std::vector<double> norms;
      for (int i = 0; i < 3; ++i) {
        auto loss = model->forward(torch::randn({8, 3}) * 10).pow(2).mean();
        double norm = 0;
        if (through_accelerator) {
          optimizer.zero_grad();
          acc.backward(loss);
          if (by_value) {
            acc.clip_grad_value_(model->parameters(), 0.5);
          } else {
            norm = acc.clip_grad_norm_(model->parameters(), 1.0);
          }
          optimizer.step();
        } else {
          sgd.zero_grad();
          scaler.scale(loss).backward();
          scaler.unscale_(sgd);
          if (by_value) {
            torch::nn::utils::clip_grad_value_(model->parameters(), 0.5);
          } else {
            norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
          }
          scaler.step(sgd);
          scaler.update();
        }
        norms.push_back(norm);
      }
      return std::make_pair(norms, model->weight.clone());
    };
    auto [want_norms, want_weight] = run(false);
    auto [norms, weight] = run(true);
    EXPECT_EQ(norms, want_norms);
    if (!by_value) {
      EXPECT_GT(norms[0], 1.0) << "the test's gradients must be large enough to clip";
    }
    EXPECT_TRUE(testing::bitwise_equal(weight, want_weight));
  }
  TempDir dir;
  Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
  torch::nn::Linear model(3, 1);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  GradScaler scaler;
  acc.prepare(model, sgd, scaler);
  acc.set_gradient_accumulation_steps(2);
  auto accumulating = acc.accumulate();
  acc.backward(model->forward(torch::ones({2, 3})).sum());
  ASSERT_FALSE(acc.sync_gradients());
  testing::expect_error([&] { acc.clip_grad_norm_(model->parameters(), 1.0); },
                        ErrorCode::InvalidArgument,
                        {"clip_grad_norm_()", "accumulates", "sync_gradients()"});
}

// Two optimizers under one GradScaler (a GAN's shape): optimizer_step({a, b}) is PyTorch's
// recipe, step each through the scaler and update the scale once per iteration, also when one
// of them meets an inf and skips. A reference loop written against the GradScaler directly
// gives the same scales and the same weights, bit for bit.
TEST(AccelerateLoops, SeveralOptimizersUpdateTheScaleOncePerIteration) {
  auto run = [](bool through_accelerator) {
    torch::manual_seed(3);
    torch::nn::Linear a(3, 1), b(3, 1);
    torch::optim::SGD opt_a(a->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt_b(b->parameters(), torch::optim::SGDOptions(0.1));
    GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
    TempDir dir;
    Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
    acc.prepare(a, opt_a, b, opt_b, scaler);
    auto x = torch::randn({8, 3});
    std::vector<double> scales;
    for (int i = 0; i < 6; ++i) {
      opt_a.zero_grad();
      opt_b.zero_grad();
      // Iteration 3: b's loss overflows, so b skips its step and the scale backs off.
      auto loss_b = b->forward(x).pow(2).mean() * (i == 3 ? 1e38 : 1.0);
      auto loss = a->forward(x).pow(2).mean() + loss_b;
      if (through_accelerator) {
        acc.backward(loss);
        std::vector<bool> stepped = acc.optimizer_step({opt_a, opt_b});
        EXPECT_EQ(stepped, (std::vector<bool>{true, i != 3})) << i;
      } else {
        scaler.scale(loss).backward();
        scaler.step(opt_a);
        scaler.step(opt_b);
        scaler.update();
      }
      scales.push_back(scaler.get_scale());
    }
    if (through_accelerator) {
      EXPECT_EQ(acc.save_state(dir / "ok"), dir / "ok") << "no scaled gradients left unconsumed";
    }
    return std::make_tuple(scales, a->weight.clone(), b->weight.clone());
  };
  auto [want_scales, want_a, want_b] = run(false);
  auto [scales, got_a, got_b] = run(true);
  EXPECT_EQ(scales, want_scales);
  EXPECT_EQ(want_scales, (std::vector<double>{1024, 2048, 2048, 1024, 1024, 2048}))
      << "grows every 2 good iterations, backs off once at iteration 3";
  EXPECT_TRUE(testing::bitwise_equal(got_a, want_a));
  EXPECT_TRUE(testing::bitwise_equal(got_b, want_b));
}

// step() counts acc.backward(loss) calls; a loop that calls loss.backward() itself gets a
// warning that says so, once, and the counting loop (the control) gets none.
TEST(AccelerateLoops, BackwardOutsideTheAcceleratorIsReported) {
  for (bool through_accelerator : {false, true}) {
    SCOPED_TRACE(through_accelerator ? "acc.backward" : "loss.backward");
    TempDir dir;
    Accelerator acc(ProjectConfiguration().project_dir(dir.path()));
    torch::nn::Linear model(3, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    acc.prepare(model, optimizer);
    auto x = torch::randn({8, 3});
    ::testing::internal::CaptureStderr();
    for (int i = 0; i < 3; ++i) {
      optimizer.zero_grad();
      auto loss = model->forward(x).pow(2).mean();
      if (through_accelerator) {
        acc.backward(loss);
      } else {
        loss.backward();
      }
      optimizer.step();
    }
    acc.save_state(dir / "a");
    acc.save_state(dir / "b");
    std::string err = ::testing::internal::GetCapturedStderr();
    if (through_accelerator) {
      EXPECT_EQ(acc.step(), 3);
      EXPECT_EQ(err, "");
    } else {
      EXPECT_EQ(acc.step(), 0);
      EXPECT_NE(err.find("3 backward pass(es) did not go through"), std::string::npos) << err;
      EXPECT_EQ(err.find("warning"), err.rfind("warning")) << "warned once: " << err;
    }
  }
}

}  // namespace
}  // namespace torchpoint
