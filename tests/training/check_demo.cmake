# Runs the training demo briefly and checks what a user would look at: the
# exit status, a line per epoch, and rank 0's verdict on the ranks' weights.
#
#   cmake -DCASE=<gloo|torch|mpi|bad_flag|cuda_vs_cpu> -DTRAIN=<dtrain_train_mlp or dtrain_train_mlp_mpi>
#         [-DMPIEXEC=<mpiexec> -DMPIEXEC_ARGS=<args before the program, |-separated>]
#         [-DTRAIN_CUDA=<dtrain_train_mlp_cuda> (CASE cuda_vs_cpu)]
#         -P check_demo.cmake
cmake_minimum_required(VERSION 3.21)
include("${CMAKE_CURRENT_LIST_DIR}/../scripts/clean_env.cmake")

function(fail)
  string(JOIN "" why ${ARGN})
  message(FATAL_ERROR "training.demo (${CASE}): ${why}\n--- stdout ---\n${out}\n--- stderr ---\n${err}")
endfunction()

# expect(<status> <regex>...): the exit status, and each regex somewhere in stdout + stderr.
function(expect status)
  if(NOT rc STREQUAL status)
    fail("exit status ${rc}, expected ${status}")
  endif()
  foreach(regex IN LISTS ARGN)
    if(NOT "${out}${err}" MATCHES "${regex}")
      fail("no line matches \"${regex}\"")
    endif()
  endforeach()
endfunction()

dtrain_clean_launcher_env()
unset(ENV{DTRAIN_NPROC_PER_NODE})  # the case says how many workers
set(small --epochs 2 --samples 2048 --seed 5)

if(CASE STREQUAL "gloo")
  set(command "${TRAIN}" --nproc-per-node 4 ${small})
  set(expected 0 "epoch 1/2 .*samples/s" "epoch 2/2 .*samples/s"
               "all 4 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
elseif(CASE STREQUAL "torch")
  # dtrain_train_torch (examples/train_torch.cpp): the same lines as the MLP demo.
  set(command "${TRAIN}" --nproc-per-node 4 ${small})
  set(expected 0 "training a CNN .* 4 ranks x batch" "epoch 1/2 .*samples/s"
               "epoch 2/2 .*samples/s" "all 4 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
elseif(CASE STREQUAL "mpi")
  string(REPLACE "|" ";" mpiexec_args "${MPIEXEC_ARGS}")
  set(command "${MPIEXEC}" ${mpiexec_args} "${TRAIN}" ${small})
  set(expected 0 "epoch 2/2 .*samples/s" "all 2 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
elseif(CASE STREQUAL "cuda_vs_cpu")
  # One rank each, same flags: the final test accuracies must agree to within
  # one point (the same samples and weights; only the float rounding differs).
  set(same --epochs 3 --seed 5)
  set(ENV{DTRAIN_NPROC_PER_NODE} 1)
  execute_process(COMMAND "${TRAIN_CUDA}" ${same} OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc TIMEOUT 200)
  if(rc EQUAL 77)
    message("${out}${err}")
    message("SKIPPED: the CUDA demo found no GPU")
    return()
  endif()
  expect(0 "epoch 3/3 ")
  if(NOT out MATCHES "epoch 3/3 [^\n]*test accuracy +([0-9.]+)%")
    fail("no test accuracy in the CUDA demo's last epoch")
  endif()
  set(gpu_accuracy ${CMAKE_MATCH_1})
  set(cuda_out "${out}")
  execute_process(COMMAND "${TRAIN}" ${same} OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc TIMEOUT 200)
  expect(0 "epoch 3/3 ")
  if(NOT out MATCHES "epoch 3/3 [^\n]*test accuracy +([0-9.]+)%")
    fail("no test accuracy in the CPU demo's last epoch")
  endif()
  set(cpu_accuracy ${CMAKE_MATCH_1})
  message("${cuda_out}${out}")
  message("training.demo (cuda_vs_cpu): GPU ${gpu_accuracy}%, CPU ${cpu_accuracy}%")
  if(gpu_accuracy LESS 50 OR cpu_accuracy LESS 50)
    fail("an accuracy below 50% after 3 epochs: GPU ${gpu_accuracy}%, CPU ${cpu_accuracy}%")
  endif()
  set(low ${cpu_accuracy})
  set(high ${gpu_accuracy})
  if(gpu_accuracy LESS cpu_accuracy)
    set(low ${gpu_accuracy})
    set(high ${cpu_accuracy})
  endif()
  # CMake has no floating point: compare in tenths of a point ("87.5" -> 875).
  string(REPLACE "." "" low_tenths "${low}")
  string(REPLACE "." "" high_tenths "${high}")
  math(EXPR gap "${high_tenths} - ${low_tenths}")
  if(gap GREATER 10)
    fail("the CUDA demo reached ${gpu_accuracy}% test accuracy, the CPU demo ${cpu_accuracy}%: "
         "more than one point apart")
  endif()
  message("training.demo (cuda_vs_cpu): ok")
  return()
elseif(CASE STREQUAL "precision")
  # --precision (issue 49): the values and gradients DDP averages and updates
  # in bfloat16 and float16 (float32 sums, float32 master weights, fp16's
  # loss scaler), at DDP and at stages 2 and 3: every run ends with identical
  # weights on every rank, and its final test accuracy within half a point of
  # the float32 run's (the runs are deterministic: the same samples, seeds).
  set(ENV{DTRAIN_NPROC_PER_NODE} 4)
  set(same --epochs 3 --samples 4096 --seed 5)
  set(summary "")
  foreach(stage 0 2 3)
    foreach(precision fp32 bf16 fp16)
      execute_process(COMMAND "${TRAIN}" ${same} --precision ${precision} --sharding ${stage}
                      OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
      expect(0 "all 4 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
      if(NOT precision STREQUAL "fp32")
        expect(0 "precision [a-z0-9]+: 16-bit values and gradients, averaged with float32 sums")
      endif()
      if(NOT out MATCHES "epoch 3/3 [^\n]*test accuracy +([0-9.]+)%")
        fail("--precision ${precision} --sharding ${stage}: no test accuracy in the last epoch")
      endif()
      set(accuracy ${CMAKE_MATCH_1})
      string(APPEND summary " ${precision}@${stage}=${accuracy}%")
      string(REPLACE "." "" tenths "${accuracy}")  # CMake has no floating point
      if(precision STREQUAL "fp32")
        set(reference ${tenths})
      else()
        math(EXPR gap "${tenths} - ${reference}")
        if(gap GREATER 5 OR gap LESS -5)
          fail("--precision ${precision} --sharding ${stage}: test accuracy ${accuracy}%, "
               "more than half a point from float32's")
        endif()
      endif()
    endforeach()
  endforeach()
  # A 16-bit job resumed from its checkpoint (the 16-bit values, the float32
  # master weights, the loss scaler's state) ends with the uninterrupted
  # run's weights.
  set(dir "${CMAKE_CURRENT_BINARY_DIR}/precision-resume-${CMAKE_CURRENT_LIST_LINE}")
  file(REMOVE_RECURSE "${dir}")
  execute_process(COMMAND "${TRAIN}" ${same} --precision fp16
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
  expect(0 "identical weights")
  string(REGEX MATCH "checksum ([0-9a-f]+)" ignored "${out}")
  set(want ${CMAKE_MATCH_1})
  execute_process(COMMAND "${TRAIN}" --epochs 1 --samples 4096 --seed 5 --precision fp16
                          --checkpoint-dir "${dir}" --checkpoint-every 10
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
  expect(0 "identical weights")
  execute_process(COMMAND "${TRAIN}" ${same} --precision fp16 --checkpoint-dir "${dir}"
                          --checkpoint-every 10
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
  file(REMOVE_RECURSE "${dir}")
  expect(0 "resumed at step" "identical weights \\(checksum ${want}\\)")
  message("training.demo (precision):${summary}; fp16 resumed from its checkpoint: checksum ${want}, "
          "bit-identical")
  return()
elseif(CASE STREQUAL "torch_precision")
  # The LibTorch example's --precision (issue 49): the module in bfloat16 (and
  # float16 where this LibTorch's CPU kernels have it; otherwise exit status
  # 2 naming the flag), DDP summing in float32 with float32 master weights:
  # the final test accuracy within half a point of float32's, every rank's
  # weights identical.
  set(ENV{DTRAIN_NPROC_PER_NODE} 4)
  set(summary "")
  foreach(precision fp32 bf16 fp16)
    execute_process(COMMAND "${TRAIN}" ${small} --precision ${precision}
                    OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 300)
    if(precision STREQUAL "fp16" AND rc EQUAL 2)
      expect(2 "--precision fp16: this LibTorch cannot run the CNN in that type on the CPU")
      string(APPEND summary " fp16: refused by name (no float16 CPU kernels)")
      continue()
    endif()
    expect(0 "all 4 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
    if(NOT out MATCHES "epoch 2/2 [^\n]*test accuracy +([0-9.]+)%")
      fail("--precision ${precision}: no test accuracy in the last epoch")
    endif()
    set(accuracy ${CMAKE_MATCH_1})
    string(APPEND summary " ${precision}=${accuracy}%")
    string(REPLACE "." "" tenths "${accuracy}")
    if(precision STREQUAL "fp32")
      set(reference ${tenths})
    else()
      expect(0 "precision [a-z0-9]+: 16-bit values and gradients, averaged with float32 sums")
      math(EXPR gap "${tenths} - ${reference}")
      if(gap GREATER 5 OR gap LESS -5)
        fail("--precision ${precision}: test accuracy ${accuracy}%, more than half a point "
             "from float32's")
      endif()
    endif()
  endforeach()
  message("training.demo (torch_precision):${summary}")
  return()
elseif(CASE STREQUAL "sharding" OR CASE STREQUAL "torch_sharding")
  # ZeRO stages (issues 34 and 48): 4 Gloo workers, --sharding 0, 1, 2 and 3;
  # the MLP demo with SGD and with Adam, the LibTorch example with
  # torch::optim::SGD over its shard_parameters(). Over Gloo every stage
  # averages and updates with the same float operations as DDP, so each must
  # end with DDP's checksum; the optimizer state per rank must shrink to about
  # a quarter (the shard plus padding), and at stage 3 the parameters per
  # rank too.
  set(ENV{DTRAIN_NPROC_PER_NODE} 4)
  set(summary "")
  set(optimizers sgd adam)
  set(stages 0 1 2 3)
  if(CASE STREQUAL "torch_sharding")
    set(optimizers torch-sgd)
  endif()
  foreach(optimizer IN LISTS optimizers)
    set(flags --optimizer ${optimizer} --lr 0.05)
    if(optimizer STREQUAL "adam")
      set(flags --optimizer adam --lr 0.003)
    elseif(optimizer STREQUAL "torch-sgd")
      set(flags "")
    endif()
    foreach(stage IN LISTS stages)
      execute_process(COMMAND "${TRAIN}" ${small} ${flags} --sharding ${stage}
                      OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
      expect(0 "epoch 2/2 .*samples/s" "all 4 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
      string(REGEX MATCH "checksum ([0-9a-f]+)" ignored "${out}")
      set(checksum ${CMAKE_MATCH_1})
      expect(0 "optimizer state per rank: [0-9]+ bytes")
      string(REGEX MATCH "optimizer state per rank: ([0-9]+) bytes" ignored "${out}")
      set(bytes ${CMAKE_MATCH_1})
      if(NOT optimizer STREQUAL "torch-sgd")
        if(NOT out MATCHES "epoch 2/2 [^\n]*test accuracy +([0-9.]+)%" OR CMAKE_MATCH_1 LESS 50)
          fail("${optimizer}, sharding ${stage}: test accuracy below 50% after 2 epochs")
        endif()
      endif()
      expect(0 "parameters per rank: [0-9]+ bytes")
      string(REGEX MATCH "parameters per rank: ([0-9]+) bytes" ignored "${out}")
      set(values ${CMAKE_MATCH_1})
      if(stage EQUAL 0)
        set(ddp_values ${values})
      elseif(stage EQUAL 3)
        # A quarter of the model's, plus at most 4 buckets' padding (3 floats each).
        math(EXPR most "${ddp_values} / 4 + 4 * 3 * 4")
        if(values GREATER most OR values LESS 1)
          fail("${optimizer}, sharding 3: parameters ${values} bytes per rank, the model's "
               "${ddp_values}: expected at most ${most}")
        endif()
        string(APPEND summary "${optimizer} sharding 3: parameters ${values} bytes per rank "
                              "(DDP: ${ddp_values})\n")
      endif()
      string(APPEND summary "${optimizer} sharding ${stage}: checksum ${checksum}, optimizer state ${bytes} bytes\n")
      if(stage EQUAL 0)
        set(ddp_checksum ${checksum})
        set(ddp_bytes ${bytes})
      else()
        if(NOT checksum STREQUAL ddp_checksum)
          fail("${optimizer}, sharding ${stage}: checksum ${checksum}, DDP's ${ddp_checksum}")
        endif()
        if(NOT bytes STREQUAL "")
          # A quarter of DDP's, plus at most 4 buckets' padding (3 floats each) per state array.
          math(EXPR most "${ddp_bytes} / 4 + 2 * 4 * 3 * 4 * 4")
          if(bytes GREATER most OR bytes LESS 1)
            fail("${optimizer}, sharding ${stage}: optimizer state ${bytes} bytes per rank, "
                 "DDP's ${ddp_bytes}: expected at most ${most}")
          endif()
        endif()
      endif()
    endforeach()
  endforeach()
  # A sharded job saved on 4 ranks resumes on 2: its optimizer state is re-cut
  # (the MLP demo: its Adam's arrays; the LibTorch example: torch::optim::SGD's
  # momentum, by dtrain::torch::add_optimizer(ckpt, optimizer, ddp)). Resumed
  # at stage 1 and at stage 2 from copies of the same checkpoint, it ends with
  # the same weights.
  set(tmp "$ENV{TMPDIR}")
  if(tmp STREQUAL "")
    set(tmp /tmp)
  endif()
  string(RANDOM LENGTH 10 suffix)
  set(dir "${tmp}/dtrain-sharding-resume-${suffix}")
  file(REMOVE_RECURSE "${dir}" "${dir}-copy")
  set(flags --optimizer adam --lr 0.003)
  if(CASE STREQUAL "torch_sharding")
    set(flags "")
  endif()
  execute_process(COMMAND "${TRAIN}" --epochs 1 --samples 2048 --seed 5 ${flags}
                          --sharding 2 --checkpoint-dir "${dir}" --checkpoint-every 5
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
  expect(0 "epoch 1/1 .*samples/s")
  file(COPY "${dir}/" DESTINATION "${dir}-copy")
  set(ENV{DTRAIN_NPROC_PER_NODE} 2)
  set(resumed "")
  foreach(stage IN ITEMS 2 1)
    set(from "${dir}")
    if(stage EQUAL 1)
      set(from "${dir}-copy")
    endif()
    execute_process(COMMAND "${TRAIN}" ${small} ${flags} --sharding ${stage}
                            --checkpoint-dir "${from}" --checkpoint-every 5
                    OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
    expect(0 "resumed at step [0-9]+: epoch [12]" "epoch 2/2 .*samples/s"
           "all 2 ranks hold identical weights \\(checksum [0-9a-f]+\\)")
    string(REGEX MATCH "checksum ([0-9a-f]+)" ignored "${out}")
    list(APPEND resumed ${CMAKE_MATCH_1})
    if(out MATCHES "epoch 2/2 [^\n]*test accuracy +([0-9.]+)%" AND CMAKE_MATCH_1 LESS 50)
      fail("resumed on 2 ranks: test accuracy below 50% after 2 epochs")
    endif()
  endforeach()
  list(GET resumed 0 at_two)
  list(GET resumed 1 at_one)
  if(NOT at_two STREQUAL at_one)
    fail("resumed on 2 ranks from the same checkpoint: sharding 2 ends with checksum ${at_two}, "
         "sharding 1 with ${at_one}")
  endif()
  file(REMOVE_RECURSE "${dir}" "${dir}-copy")
  string(APPEND summary "saved on 4 ranks (sharding 2), resumed on 2 (sharding 2 and 1): "
                        "checksum ${at_two} both\n")
  # ZeRO stage 3: the values are a sharded entry too (checkpoint::add_sharded(
  # "parameters", ddp); LibTorch: dtrain::torch::add_module(ckpt, ddp)). Saved
  # on 4 ranks after one epoch: resumed on 2 it must end as the stage-2
  # checkpoint resumed on 2 (the stages give the same bits), resumed on 4 as
  # the run that never stopped.
  set(ENV{DTRAIN_NPROC_PER_NODE} 4)
  execute_process(COMMAND "${TRAIN}" --epochs 1 --samples 2048 --seed 5 ${flags}
                          --sharding 3 --checkpoint-dir "${dir}" --checkpoint-every 5
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
  expect(0 "epoch 1/1 .*samples/s")
  file(COPY "${dir}/" DESTINATION "${dir}-copy")
  set(stage3 "")
  foreach(run IN ITEMS resumed-4 uninterrupted-4 resumed-2)
    set(resume --checkpoint-dir "${dir}-copy" --checkpoint-every 5)
    set(ranks 4)
    if(run STREQUAL "uninterrupted-4")
      set(resume "")
    elseif(run STREQUAL "resumed-2")
      set(resume --checkpoint-dir "${dir}" --checkpoint-every 5)
      set(ranks 2)
    endif()
    set(ENV{DTRAIN_NPROC_PER_NODE} ${ranks})
    execute_process(COMMAND "${TRAIN}" ${small} ${flags} --sharding 3 ${resume}
                    OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc TIMEOUT 150)
    expect(0 "epoch 2/2 .*samples/s"
           "all ${ranks} ranks hold identical weights \\(checksum [0-9a-f]+\\)")
    if(NOT run STREQUAL "uninterrupted-4" AND NOT out MATCHES "resumed at step [0-9]+: epoch")
      fail("sharding 3, ${run}: it did not resume from the stage-3 checkpoint")
    endif()
    string(REGEX MATCH "checksum ([0-9a-f]+)" ignored "${out}")
    list(APPEND stage3 ${CMAKE_MATCH_1})
  endforeach()
  list(GET stage3 0 resumed_four)
  list(GET stage3 1 uninterrupted_four)
  list(GET stage3 2 resumed_two)
  if(NOT resumed_four STREQUAL uninterrupted_four)
    fail("sharding 3 saved on 4 ranks and resumed on 4 ends with checksum ${resumed_four}, "
         "the uninterrupted run with ${uninterrupted_four}")
  endif()
  if(NOT resumed_two STREQUAL at_two)
    fail("sharding 3 saved on 4 ranks and resumed on 2 ends with checksum ${resumed_two}, "
         "the stage-2 checkpoint resumed on 2 with ${at_two}")
  endif()
  file(REMOVE_RECURSE "${dir}" "${dir}-copy")
  string(APPEND summary "saved on 4 ranks (sharding 3): resumed on 4, checksum "
                        "${resumed_four} as uninterrupted; on 2, ${resumed_two} as sharding 2\n")
  message("${summary}training.demo (${CASE}): ok")
  return()
elseif(CASE STREQUAL "bad_flag")
  set(command "${TRAIN}" --epochs many)
  set(expected 2 "--epochs many: expected a number")
else()
  message(FATAL_ERROR "check_demo.cmake: unknown CASE '${CASE}'")
endif()

execute_process(COMMAND ${command} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc
                TIMEOUT 100)
expect(${expected})
if(CASE STREQUAL "gloo" OR CASE STREQUAL "mpi")
  # Training must actually learn: 8 classes, so chance is 12.5%.
  if(NOT out MATCHES "epoch 2/2 [^\n]*test accuracy +([0-9.]+)%")
    fail("no test accuracy in the last epoch's line")
  endif()
  if(CMAKE_MATCH_1 LESS 50)
    fail("test accuracy ${CMAKE_MATCH_1}% after 2 epochs; expected at least 50%")
  endif()
endif()
message("${out}${err}")
message("training.demo (${CASE}): ok")
