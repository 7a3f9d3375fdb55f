/* A disk-head model for benchmarks, as an nbdkit cc plugin: a file whose every
 * request costs base_us plus seek_ms times the distance from the end of the
 * previous request, as a fraction of the whole file (a full stroke), one request
 * at a time. bench/writecache.py serves it through nbdfuse as the origin of a
 * writecache, to compare writeback orders where seeks cost time.
 *
 *   nbdkit cc bench/seekdisk.c file=ORIGIN seek_ms=8 base_us=100
 */
#define NBDKIT_API_VERSION 2
#include <nbdkit-plugin.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>

#define THREAD_MODEL NBDKIT_THREAD_MODEL_SERIALIZE_ALL_REQUESTS

static const char *file;
static double seek_ms = 8, base_us = 100;
static int fd = -1;
static int64_t size, head;

static int sd_config(const char *key, const char *value) {
  if (strcmp(key, "file") == 0) file = value;
  else if (strcmp(key, "seek_ms") == 0) seek_ms = atof(value);
  else if (strcmp(key, "base_us") == 0) base_us = atof(value);
  else { nbdkit_error("unknown parameter %s", key); return -1; }
  return 0;
}

static int sd_get_ready(void) {
  struct stat st;
  if (!file) { nbdkit_error("file= is required"); return -1; }
  fd = open(file, O_RDWR);
  if (fd < 0 || fstat(fd, &st) < 0) { nbdkit_error("%s: %m", file); return -1; }
  size = st.st_size;
  return 0;
}

static void *sd_open(int readonly) { static int h; return &h; }
static int64_t sd_get_size(void *h) { return size; }

static void cost(uint64_t off, uint32_t count) {
  int64_t d = (int64_t)off - head;
  if (d < 0) d = -d;
  double us = base_us + seek_ms * 1000.0 * (double)d / (double)(size ? size : 1);
  struct timespec t = { (time_t)(us / 1e6), (long)((us - (double)(time_t)(us / 1e6) * 1e6) * 1000) };
  nanosleep(&t, NULL);
  head = off + count;
}

static int sd_pread(void *h, void *buf, uint32_t count, uint64_t off, uint32_t flags) {
  cost(off, count);
  while (count > 0) {
    ssize_t r = pread(fd, buf, count, off);
    if (r <= 0) { nbdkit_error("pread: %m"); return -1; }
    buf = (char *)buf + r; count -= r; off += r;
  }
  return 0;
}

static int sd_pwrite(void *h, const void *buf, uint32_t count, uint64_t off, uint32_t flags) {
  cost(off, count);
  while (count > 0) {
    ssize_t r = pwrite(fd, buf, count, off);
    if (r <= 0) { nbdkit_error("pwrite: %m"); return -1; }
    buf = (const char *)buf + r; count -= r; off += r;
  }
  return 0;
}

static int sd_flush(void *h, uint32_t flags) { return fdatasync(fd); }

static struct nbdkit_plugin plugin = {
  .name = "seekdisk",
  .config = sd_config,
  .get_ready = sd_get_ready,
  .open = sd_open,
  .get_size = sd_get_size,
  .pread = sd_pread,
  .pwrite = sd_pwrite,
  .flush = sd_flush,
};

NBDKIT_REGISTER_PLUGIN(plugin)
