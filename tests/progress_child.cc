// Child of learner_test's terminal test: fits the shared linear job with validation and
// prints its progress to stdout, as a user's program does. Each batch sleeps SLEEP_MS
// milliseconds so that the bar is redrawn several times per pass.
#include <chrono>
#include <cstdlib>
#include <thread>

#include "tests/learner_job.h"

namespace tp = torchpoint;

namespace {

struct Slow : tp::Callback {
  explicit Slow(int ms) : Callback("slow"), ms_(ms) {}
  void on_train_batch_end(tp::Context&) override { pause(); }
  void on_valid_batch_end(tp::Context&) override { pause(); }
  void pause() const { std::this_thread::sleep_for(std::chrono::milliseconds(ms_)); }
  int ms_;
};

}  // namespace

int main(int argc, char** argv) {
  int sleep_ms = argc > 1 ? std::atoi(argv[1]) : 20;
  auto data = tp::testing::seed_data(320);
  tp::testing::linear_learner()->fit(
      {data.x, data.y}, tp::FitOptions()
                            .epochs(2)
                            .batch_size(32)
                            .valid_data({data.x.slice(0, 0, 160), data.y.slice(0, 0, 160)})
                            .callbacks({std::make_shared<Slow>(sleep_ms)}));
  return 0;
}
