/*
 * LD_PRELOAD'ed into llama-server on CPUs with AMX (benchmarks/run_all.py). Linux hands out the AMX tile
 * state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; see the
 * kernel's Documentation/arch/x86/xstate.rst); a process that runs an AMX instruction without asking dies of
 * SIGILL. ggml's AMX kernels do not ask, so llama-server built with them dies on its first batch unless
 * something asks for it first: this constructor, before main. The permission is the whole process's.
 */
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

__attribute__((constructor)) static void request_amx_permission(void) {
    syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

/* For the loader's check that this library was built and loads. */
int amx_permission_loaded(void) { return 1; }
