// Every GPU kernel a process runs, with its device time: a CUDA injection library (the driver
// loads it at cuInit when CUDA_INJECTION64_PATH names it) that asks CUPTI for kernel activity
// records and writes one line per kernel, "name<TAB>start ns<TAB>end ns", to the file
// $OXRL_KERNEL_TRACE when the process exits. Unlike Nsight Compute it replays nothing: the
// program runs at its own speed, so a whole training step of a real model can be traced, and
// the kernels counted (launches per decode step) and timed (device time against wall time).
//
// Built by scripts/gpu_bundle.sh into .gpu/ against the CUPTI of scripts/install_cuda.sh;
// used by scripts/gpu_check.sh. Benchmark tooling only: nothing in oxrl links it.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE* out;

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *size = 16u << 20;
    *buffer = (uint8_t*)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    (void)size;
    CUpti_Activity* record = NULL;
    while (out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)record;
            fprintf(out, "%s\t%llu\t%llu\n", k->name, (unsigned long long)k->start, (unsigned long long)k->end);
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped > 0 && out)
        fprintf(out, "#dropped\t%zu\t0\n", dropped);
    if (out) fflush(out);
    free(buffer);
}

static void finish(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (out) fclose(out), out = NULL;
}

// The driver's entry point for injection libraries; nonzero = loaded.
int InitializeInjection(void) {
    const char* path = getenv("OXRL_KERNEL_TRACE");
    out = fopen(path ? path : "kernel_trace.tsv", "w");
    if (!out) return 0;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
        fprintf(out, "#error\tCUPTI refused the kernel activity\t0\n");
        return 0;
    }
    // Records reach the file within half a second even if the process never exits cleanly
    // (a hang at exit killed by a time limit loses only the last moments).
    cuptiActivityFlushPeriod(500);
    atexit(finish);
    return 1;
}
