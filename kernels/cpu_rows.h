/* CALL(R) for a compile-time row count R = mr, 1..7, and 8 for anything larger: the tiled GEMMs
 * (cpu_gemm.c, cpu_gemm_i8dot.c, cpu_head.c) instantiate their row tiles through it. */
#ifndef TRITIUM_CPU_ROWS_H
#define TRITIUM_CPU_ROWS_H

#define DISPATCH(CALL, mr)                                   \
    switch (mr) {                                            \
    case 1: CALL(1); break; case 2: CALL(2); break;          \
    case 3: CALL(3); break; case 4: CALL(4); break;          \
    case 5: CALL(5); break; case 6: CALL(6); break;          \
    case 7: CALL(7); break; default: CALL(8); break;         \
    }

#endif
