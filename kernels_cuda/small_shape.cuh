// The shape the one-kernel blocks of a small model (attn_block.cu, attn_o.cu) compile with when
// none is given: SmolLM2-135M's (64-wide heads, 3 query heads a KV head, hidden 576). Their
// Python side always passes each as -D; these defaults serve standalone builds (CI's nvcc).
#pragma once
#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 3
#endif
#ifndef HIDDEN
#define HIDDEN 576
#endif
