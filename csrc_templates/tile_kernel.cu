// One stitched region, tile scheme: ${summary}
// One block per batch element's TA x TB tile, grid-stride over the tiles (one wave of blocks); the
// next tile's inputs are copied into the other stage buffer while this one is worked on. Epochs end
// at block barriers; values along one tile axis live in shared arrays.
${common}

#define N_ROWS js_n_rows  // (JS_ROWS_PARAM)
#define TA ${ta}
#define TB ${tb}
#define TILE (TA * TB)
#define BLOCK ${block}
#define NWARPS (BLOCK / 32)
#define GROUP ${group}
#define SLICES ${slices}
#define STAGE ${stage}

extern "C" __global__ void __launch_bounds__(BLOCK, ${min_blocks}) ${name}(${params} JS_ROWS_PARAM) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  extern __shared__ __align__(16) unsigned char js_dyn[];
${arrays}
  int js_buf = 0;
${prologue}
  for (long long row = blockIdx.x; row < N_ROWS; row += gridDim.x) {
    const long long js_next = row + gridDim.x;
    const bool js_more = js_next < N_ROWS;
${loop_top}
    js_stage_wait<1>();  // this thread's copies of this tile have landed
    __syncthreads();     // ... and everyone's
${body}
${loop_end}
    __syncthreads();  // the next tile reuses shared memory
    js_buf ^= 1;
  }
}
