// One stitched region, tile scheme: ${summary}
// Each batch element's TA x TB tile is worked on by BLOCK threads: the whole block, or with TEAMS > 1
// one warp of it (the block's TEAMS warps each walk their own tiles, with their own shared memory),
// grid-stride over the tiles (one wave of blocks); the next tile's inputs are copied into the other
// stage buffer while this one is worked on. Epochs end at JS_TILE_SYNC (a block barrier, or the
// warp's); values along one tile axis live in shared arrays.
${common}

#define N_ROWS js_n_rows  // (JS_ROWS_PARAM)
#define TA ${ta}
#define TB ${tb}
#define TILE (TA * TB)
#define TEAMS ${teams}
#define BLOCK ${team}
#define NWARPS (BLOCK / 32)
#define GROUP ${group}
#define SLICES ${slices}
#define STAGE ${stage}
#define TEAM_SMEM ${team_smem}
#if TEAMS > 1
#define JS_TILE_SYNC() __syncwarp()
#else
#define JS_TILE_SYNC() __syncthreads()
#endif

extern "C" __global__ void __launch_bounds__(BLOCK * TEAMS, ${min_blocks}) ${name}(${params} JS_ROWS_PARAM) {
  const int js_team = TEAMS > 1 ? (int)threadIdx.x / BLOCK : 0;
  const int tid = TEAMS > 1 ? (int)threadIdx.x % BLOCK : (int)threadIdx.x, lane = tid % 32, warp = tid / 32;
  extern __shared__ __align__(16) unsigned char js_smem[];
  unsigned char* const js_dyn = js_smem + js_team * TEAM_SMEM;
  const long long js_first = (long long)blockIdx.x * TEAMS + js_team;
  const long long js_stride = (long long)gridDim.x * TEAMS;
${arrays}
  int js_buf = 0;
${prologue}
  for (long long row = js_first; row < N_ROWS; row += js_stride) {
    const long long js_next = row + js_stride;
    const bool js_more = js_next < N_ROWS;
${loop_top}
    js_stage_wait<1>();  // this thread's copies of this tile have landed
    JS_TILE_SYNC();      // ... and everyone's
${body}
${loop_end}
    JS_TILE_SYNC();  // the next tile reuses shared memory
    js_buf ^= 1;
  }
}
