// Everything torchpoint offers, in one include (like <torch/torch.h>). Include the individual
// headers instead to keep compile times down.
#pragma once

#include "torchpoint/accelerator.h"
#include "torchpoint/callbacks.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/data_loader.h"
#include "torchpoint/data_position.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/grad_scaler.h"
#include "torchpoint/interop.h"
#include "torchpoint/learner.h"
#include "torchpoint/lr_scheduler.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/records_plot.h"
#include "torchpoint/retention.h"
#include "torchpoint/rng_state.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/stateful_set.h"
#include "torchpoint/tensor_file.h"
