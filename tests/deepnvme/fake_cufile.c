/* A stand-in for libcufile.so with the cufile.h ABI, for testing fastpersist's ctypes binding on a machine
 * without CUDA: cuFileRead/cuFileWrite are pread/pwrite into *host* memory at (base + buffer offset).
 *
 * Built by tests/deepnvme/test_gds_selection.py with `cc -shared -fPIC`; -DOPEN_STATUS=N makes
 * cuFileDriverOpen fail with CUfileOpError N. Knobs for one test at a time (set through ctypes on the loaded
 * library, never through the environment): fake_set_io_status(code) makes the next transfers fail with
 * -code (or -1 with errno = code when errno_mode), fake_set_max_chunk(n) makes transfers short (n bytes per call),
 * fake_set_delay_us(n) makes each read sleep n microseconds (a slow device, for the GIL test).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef OPEN_STATUS
#define OPEN_STATUS 0
#endif

typedef struct {
    int err;
    int cu_err;
} CUfileError_t;

typedef struct {
    int type;
    union {
        int fd;
        void *handle;
    } handle;
    const void *fs_ops;
} CUfileDescr_t;

static int io_status = 0;
static int errno_mode = 0;
static long max_chunk = 0;
static int open_handles = 0;
static int driver_opened = 0;
static long delay_us = 0;

#define MAX_REGISTERED 64
static const void *registered[MAX_REGISTERED];
static size_t registered_length[MAX_REGISTERED];

static CUfileError_t status(int err) {
    CUfileError_t s = {err, 0};
    return s;
}

void fake_set_io_status(int code, int as_errno) {
    io_status = code;
    errno_mode = as_errno;
}
void fake_set_max_chunk(long n) { max_chunk = n; }
void fake_set_delay_us(long n) { delay_us = n; }
int fake_open_handles(void) { return open_handles; }
int fake_driver_opened(void) { return driver_opened; }
long fake_registered_length(const void *p) {
    for (int i = 0; i < MAX_REGISTERED; i++)
        if (registered[i] == p) return (long)registered_length[i];
    return -1;
}

CUfileError_t cuFileDriverOpen(void) {
    if (OPEN_STATUS == 0) driver_opened = 1;
    return status(OPEN_STATUS);
}

CUfileError_t cuFileGetVersion(int *version) {
    *version = 1234;
    return status(0);
}

CUfileError_t cuFileHandleRegister(void **fh, CUfileDescr_t *descr) {
    if (!driver_opened) return status(5001);
    if (descr->type != 1 || descr->fs_ops != NULL || descr->handle.fd < 0) return status(5022);
    int *p = malloc(sizeof(int));
    *p = descr->handle.fd;
    *fh = p;
    open_handles++;
    return status(0);
}

void cuFileHandleDeregister(void *fh) {
    if (fh == NULL) return;
    free(fh);
    open_handles--;
}

CUfileError_t cuFileBufRegister(const void *p, size_t length, int flags) {
    (void)flags;
    for (int i = 0; i < MAX_REGISTERED; i++)
        if (registered[i] == p) return status(5023);
    for (int i = 0; i < MAX_REGISTERED; i++)
        if (registered[i] == NULL) {
            registered[i] = p;
            registered_length[i] = length;
            return status(0);
        }
    return status(5030);
}

CUfileError_t cuFileBufDeregister(const void *p) {
    for (int i = 0; i < MAX_REGISTERED; i++)
        if (registered[i] == p) {
            registered[i] = NULL;
            return status(0);
        }
    return status(5024);
}

static ssize_t fail(void) {
    if (errno_mode) {
        errno = io_status;
        return -1;
    }
    return -io_status;
}

ssize_t cuFileRead(void *fh, void *base, size_t size, off_t file_offset, off_t buffer_offset) {
    if (delay_us) usleep((useconds_t)delay_us);
    if (io_status) return fail();
    if (max_chunk && size > (size_t)max_chunk) size = (size_t)max_chunk;
    return pread(*(int *)fh, (char *)base + buffer_offset, size, file_offset);
}

ssize_t cuFileWrite(void *fh, const void *base, size_t size, off_t file_offset, off_t buffer_offset) {
    if (io_status) return fail();
    if (max_chunk && size > (size_t)max_chunk) size = (size_t)max_chunk;
    return pwrite(*(int *)fh, (const char *)base + buffer_offset, size, file_offset);
}
