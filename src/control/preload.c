/*
 * dmkit's door for unmodified programs: preloaded by `dmkit exec`, it makes the
 * device-mapper control node reach the dmkit daemon (see src/control/preload.rs
 * for why this is C). Everything that is not the control node goes to libc.
 *
 *  - open/open64/openat/openat64 (and the _FORTIFY_SOURCE entries) of
 *    /dev/mapper/control, or $DM_DEV_DIR/mapper/control: a socket connected to
 *    $DMKIT_DOOR_SOCKET, one connection per open, as the kernel's one file per open;
 *  - ioctl on such a descriptor: the dm_ioctl buffer (data_size bytes, as the
 *    kernel copies it) goes to the daemon; the reply is copied back over it;
 *  - stat/lstat/fstat of the node: a character device 10:236, as libdevmapper
 *    checks before it opens it (else it would try to mknod one);
 *  - /proc/devices and /proc/misc (fopen and open): with a `device-mapper` line
 *    (block major 253, misc minor 236), where libdevmapper and LVM read them;
 *  - open of a block node 253:N (/dev/mapper/NAME, /dev/VG/LV, /dev/dm-N), which
 *    has no driver here: the device's file $DMKIT_DEVICE_FILES/253:N, which the
 *    daemon serves (src/export/files.rs); on that descriptor, fstat says it is the
 *    block device and the block-device ioctls (size, sector sizes, read-only,
 *    flush, discard, zeroing) are answered from the file;
 *  - stat of a node that is a dmkit device's ublk block device (as
 *    /dev/mapper/NAME is under `serve --attach`): the device-mapper number
 *    253:N, from $DMKIT_RUN_DIR/block-numbers, so that libdevmapper and LVM see
 *    one device; its I/O goes to the kernel's block device.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/dm-ioctl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/xattr.h>
#include <unistd.h>

#define DM_MAJOR 253
#define MISC_MAJOR 10
#define DM_CONTROL_MINOR 236
#define MIN_DATA_SIZE 305u
#define BUFFER_LIMIT (64u << 20)
#define MAX_FD 65536

static char door_socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
static char files_dir[4096];
static const char *files_error;
static char dev_dir[4096];
/* minor + 1 of the device each descriptor opened as its file, 0 for none */
static uint32_t *blk_minor;
static char control_alt[4096];
/* $DMKIT_RUN_DIR/block-numbers: MAJOR:MINOR -> 253:N for attached devices */
static char numbers_dir[4096];
/* CONTROL: a program's open of the control node; CONN: a thread's connection */
#define CONTROL 1
#define CONN 2
static unsigned char ours[MAX_FD];
/* Each thread's own connection to the daemon, for its requests: threads of one
 * program (dmeventd's) wait in DEV_WAIT while others go on, as on the kernel's
 * one control node; made again after a fork. */
static __thread int thread_conn = -1;
static __thread pid_t thread_pid;
/* This thread's buffer for whole replies (read_reply). */
static __thread char *reply_buf;
static __thread size_t reply_cap;
static pthread_key_t conn_key;
static pthread_once_t conn_once = PTHREAD_ONCE_INIT;

/* A thread's connection goes with the thread. */
static void conn_gone(void *v)
{
	free(reply_buf);
	reply_buf = NULL;
	reply_cap = 0;
	int fd = (int)(intptr_t)v - 1;
	if (fd >= 0 && fd < MAX_FD && ours[fd] == 2 && thread_conn == fd) {
		ours[fd] = 0;
		close(fd);
	}
}

static void conn_key_init(void)
{
	pthread_key_create(&conn_key, conn_gone);
}

static void *next_fn(const char *name)
{
	return dlsym(RTLD_NEXT, name);
}

#define REAL(ret, name, args)                                  \
	static ret(*real_##name) args;                             \
	static ret(*get_##name(void)) args                         \
	{                                                          \
		if (!real_##name)                                      \
			real_##name = (ret(*) args)next_fn(#name);         \
		return real_##name;                                    \
	}

REAL(int, open, (const char *, int, ...))
REAL(int, open64, (const char *, int, ...))
REAL(int, openat, (int, const char *, int, ...))
REAL(int, openat64, (int, const char *, int, ...))
REAL(int, ioctl, (int, unsigned long, ...))
REAL(int, close, (int))
REAL(FILE *, fopen, (const char *, const char *))
REAL(FILE *, fopen64, (const char *, const char *))
REAL(int, stat, (const char *, struct stat *))
REAL(int, stat64, (const char *, struct stat64 *))
REAL(int, lstat, (const char *, struct stat *))
REAL(int, lstat64, (const char *, struct stat64 *))
REAL(int, fstat, (int, struct stat *))
REAL(int, fstat64, (int, struct stat64 *))
REAL(int, __xstat, (int, const char *, struct stat *))
REAL(int, __xstat64, (int, const char *, struct stat64 *))
REAL(int, __lxstat, (int, const char *, struct stat *))
REAL(int, __lxstat64, (int, const char *, struct stat64 *))
REAL(int, __fxstat, (int, int, struct stat *))
REAL(int, __fxstat64, (int, int, struct stat64 *))

__attribute__((constructor)) static void door_init(void)
{
	const char *s = getenv("DMKIT_DOOR_SOCKET");
	if (s && strlen(s) < sizeof(door_socket))
		strcpy(door_socket, s);
	const char *f = getenv("DMKIT_DEVICE_FILES");
	if (f && strlen(f) + 32 < sizeof(files_dir))
		strcpy(files_dir, f);
	files_error = getenv("DMKIT_DEVICE_FILES_ERROR");
	const char *r = getenv("DMKIT_RUN_DIR");
	if (r && strlen(r) + 64 < sizeof(numbers_dir))
		snprintf(numbers_dir, sizeof(numbers_dir), "%s/block-numbers", r);
	const char *d = getenv("DM_DEV_DIR");
	if (d && strlen(d) + 2 < sizeof(dev_dir))
		snprintf(dev_dir, sizeof(dev_dir), "%s/", d);
	if (d && strlen(d) + sizeof("/mapper/control") < sizeof(control_alt))
		snprintf(control_alt, sizeof(control_alt), "%s/mapper/control", d);
}

/* Paths equal but for repeated slashes. */
static int same_path(const char *a, const char *b)
{
	while (*a && *b) {
		if (*a != *b)
			return 0;
		if (*a == '/') {
			while (*a == '/')
				a++;
			while (*b == '/')
				b++;
		} else {
			a++;
			b++;
		}
	}
	while (*a == '/')
		a++;
	while (*b == '/')
		b++;
	return !*a && !*b;
}

static int is_control(const char *path)
{
	return path && (same_path(path, "/dev/mapper/control") ||
			(control_alt[0] && same_path(path, control_alt)));
}

static int is_ours(int fd)
{
	return fd >= 0 && fd < MAX_FD && ours[fd] == CONTROL;
}

static int open_door(int flags)
{
	if (!door_socket[0]) {
		errno = ENODEV;
		return -1;
	}
	int fd = socket(AF_UNIX, SOCK_STREAM | ((flags & O_CLOEXEC) ? SOCK_CLOEXEC : 0), 0);
	if (fd < 0)
		return -1;
	struct sockaddr_un a;
	memset(&a, 0, sizeof(a));
	a.sun_family = AF_UNIX;
	strcpy(a.sun_path, door_socket);
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
		int e = errno;
		get_close()(fd);
		fprintf(stderr, "dmkit: no dmkit daemon answers at %s (%s): start one with `dmkit serve --background`\n",
			door_socket, strerror(e));
		errno = ENODEV;
		return -1;
	}
	if (fd >= MAX_FD) {
		get_close()(fd);
		errno = EMFILE;
		return -1;
	}
	ours[fd] = 1;
	return fd;
}

/* The synthetic /proc files: the real one with dmkit's device-mapper line. */
static int proc_fd(const char *path)
{
	int misc = strcmp(path, "/proc/misc") == 0;
	if (!misc && strcmp(path, "/proc/devices") != 0)
		return -2;
	int in = get_open()(path, O_RDONLY | O_CLOEXEC);
	char *text = malloc(65536);
	if (!text) {
		if (in >= 0)
			get_close()(in);
		return -1;
	}
	size_t n = 0;
	ssize_t r;
	while (in >= 0 && n < 65535 && (r = read(in, text + n, 65535 - n)) > 0)
		n += (size_t)r;
	if (in >= 0)
		get_close()(in);
	text[n] = 0;
	int out = memfd_create(misc ? "proc-misc" : "proc-devices", MFD_CLOEXEC);
	if (out < 0) {
		free(text);
		return -1;
	}
	char line[64];
	int added = 0;
	for (char *l = text; *l;) {
		char *end = strchr(l, '\n');
		size_t len = end ? (size_t)(end - l) + 1 : strlen(l);
		/* a device-mapper line of the kernel's is replaced by dmkit's */
		int dm = len >= 14 && memcmp(l + len - (end ? 14 : 13), "device-mapper", 13) == 0;
		if (!dm && write(out, l, len) < 0)
			break;
		if (!misc && !added && len >= 14 && strncmp(l, "Block devices:", 14) == 0) {
			int k = snprintf(line, sizeof(line), "%3d device-mapper\n", DM_MAJOR);
			if (write(out, line, (size_t)k) < 0)
				break;
			added = 1;
		}
		l += len;
	}
	if (misc || !added) {
		int k = misc ? snprintf(line, sizeof(line), "%3d device-mapper\n", DM_CONTROL_MINOR)
			     : snprintf(line, sizeof(line), "\nBlock devices:\n%3d device-mapper\n", DM_MAJOR);
		if (write(out, line, (size_t)k) < 0) {
			/* the file is shorter; the reader finds no line */
		}
	}
	free(text);
	lseek(out, 0, SEEK_SET);
	return out;
}

static int sysfs_fd(const char *path);

/* The files answered here: -2 for any other path. */
static int special_fd(const char *path)
{
	if (!path)
		return -2;
	if (strncmp(path, "/proc/", 6) == 0)
		return proc_fd(path);
	if (strncmp(path, "/sys/dev/block/", 15) == 0)
		return sysfs_fd(path);
	return -2;
}

static int is_blk(int fd)
{
	return fd >= 0 && fd < MAX_FD && blk_minor && blk_minor[fd];
}

/* Where device nodes are: /dev, or $DM_DEV_DIR. */
static int under_dev(const char *path)
{
	return strncmp(path, "/dev/", 5) == 0 || (dev_dir[0] && strncmp(path, dev_dir, strlen(dev_dir)) == 0);
}

/* The minor of the dmkit block node `path` names (following links), or -1. */
static long dm_node_minor(int dirfd, const char *path)
{
	struct stat st;
	(void)dirfd; /* nodes are named by absolute paths */
	if (!path || path[0] != '/' || !under_dev(path))
		return -1;
	if (get_stat()(path, &st) != 0 || !S_ISBLK(st.st_mode) || major(st.st_rdev) != DM_MAJOR)
		return -1;
	return (long)minor(st.st_rdev);
}

/* A dmkit device's node: its file instead (-2 when `path` is not one). */
static int open_device_file(int dirfd, const char *path, int flags, mode_t mode)
{
	long m = dm_node_minor(dirfd, path);
	if (m < 0)
		return -2;
	if (!files_dir[0]) {
		static int told;
		if (!told && files_error) {
			told = 1;
			fprintf(stderr, "dmkit: %s is a dmkit device, but its file is not served: %s\n", path,
				files_error);
		}
		return -2;
	}
	if (!blk_minor && !(blk_minor = calloc(MAX_FD, sizeof(*blk_minor)))) {
		errno = ENOMEM;
		return -1;
	}
	char file[sizeof(files_dir) + 32];
	snprintf(file, sizeof(file), "%s/%u:%ld", files_dir, DM_MAJOR, m);
	int fd = get_open()(file, flags & ~(O_CREAT | O_EXCL | O_TRUNC), mode);
	if (fd < 0) {
		if (errno == ENOENT)
			errno = ENXIO; /* a node left by a removed device */
		return -1;
	}
	if (fd >= MAX_FD) {
		get_close()(fd);
		errno = EMFILE;
		return -1;
	}
	blk_minor[fd] = (uint32_t)m + 1;
	return fd;
}

static int open_common(int dirfd, const char *path, int flags, mode_t mode)
{
	if (is_control(path))
		return open_door(flags);
	int fd = special_fd(path);
	if (fd != -2)
		return fd;
	return open_device_file(dirfd, path, flags, mode);
}

#define OPEN_BODY(dirfd, realcall)                             \
	mode_t mode = 0;                                           \
	if (flags & (O_CREAT | __O_TMPFILE)) {                     \
		va_list ap;                                            \
		va_start(ap, flags);                                   \
		mode = va_arg(ap, mode_t);                             \
		va_end(ap);                                            \
	}                                                          \
	int fd = open_common(dirfd, path, flags, mode);            \
	if (fd != -2)                                              \
		return fd;                                             \
	return realcall;

int open(const char *path, int flags, ...)
{
	OPEN_BODY(AT_FDCWD, get_open()(path, flags, mode))
}

int open64(const char *path, int flags, ...)
{
	OPEN_BODY(AT_FDCWD, get_open64()(path, flags, mode))
}

int openat(int dirfd, const char *path, int flags, ...)
{
	OPEN_BODY(dirfd, get_openat()(dirfd, path, flags, mode))
}

int openat64(int dirfd, const char *path, int flags, ...)
{
	OPEN_BODY(dirfd, get_openat64()(dirfd, path, flags, mode))
}

int __open_2(const char *path, int flags)
{
	return open(path, flags);
}

int __open64_2(const char *path, int flags)
{
	return open64(path, flags);
}

static FILE *fopen_common(const char *path, const char *mode, FILE *(*real)(const char *, const char *))
{
	int fd = special_fd(path);
	if (fd == -2)
		return real(path, mode);
	if (fd < 0)
		return NULL;
	FILE *f = fdopen(fd, "r");
	if (!f)
		get_close()(fd);
	return f;
}

FILE *fopen(const char *path, const char *mode)
{
	return fopen_common(path, mode, get_fopen());
}

FILE *fopen64(const char *path, const char *mode)
{
	return fopen_common(path, mode, get_fopen64());
}

static int write_all(int fd, const void *p, size_t n)
{
	const char *c = p;
	while (n) {
		ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		c += w;
		n -= (size_t)w;
	}
	return 0;
}

/* A request's header (16 bytes), the carried bytes of its buffer and the
 * directory in one system call where the socket takes them at once; 0, or -1
 * when it failed. */
static int send_frame(int fd, const void *head, const void *buf, size_t len, const char *cwd, size_t cwd_len)
{
	struct iovec iov[3] = {
		{(void *)head, 16},
		{(void *)buf, len},
		{(void *)cwd, cwd_len},
	};
	struct msghdr m;
	memset(&m, 0, sizeof(m));
	m.msg_iov = iov;
	m.msg_iovlen = 3;
	ssize_t w;
	do
		w = sendmsg(fd, &m, MSG_NOSIGNAL);
	while (w < 0 && errno == EINTR);
	if (w < 0)
		return -1;
	/* the rest, part by part, when the socket took less */
	size_t done = (size_t)w;
	for (int i = 0; i < 3; i++) {
		if (done >= iov[i].iov_len) {
			done -= iov[i].iov_len;
			continue;
		}
		if (write_all(fd, (const char *)iov[i].iov_base + done, iov[i].iov_len - done))
			return -1;
		done = 0;
	}
	return 0;
}

/* -1: failed; -2: interrupted by a signal (only when `interruptible`). */
static int read_all(int fd, void *p, size_t n, int interruptible)
{
	char *c = p;
	while (n) {
		ssize_t r = read(fd, c, n);
		if (r < 0 && errno == EINTR) {
			if (interruptible)
				return -2;
			continue;
		}
		if (r <= 0)
			return -1;
		c += r;
		n -= (size_t)r;
	}
	return 0;
}

/*
 * A reply on a thread's connection (which carries nothing else) in as few
 * reads as it arrives in, usually one: the header into `rep`, the bytes to
 * copy back into `buf` (at most `len`), and in `*early` the first bytes of the
 * reason that came with them (`*early_len`, at most the reason's length).
 * 0, or -1 when the connection failed or the reply does not fit.
 */
static int read_reply(int fd, int32_t rep[3], void *buf, uint32_t len, const char **early, uint32_t *early_len)
{
	size_t want = 12 + (size_t)len + 512;
	if (reply_cap < want) {
		char *b = realloc(reply_buf, want);
		if (!b)
			return -1;
		reply_buf = b;
		reply_cap = want;
	}
	size_t have = 0;
	while (have < 12) {
		ssize_t k = read(fd, reply_buf + have, want - have);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		have += (size_t)k;
	}
	memcpy(rep, reply_buf, 12);
	uint32_t body = (uint32_t)rep[1], why = (uint32_t)rep[2];
	if (body > len || (size_t)body + why + 12 < have)
		return -1;
	size_t got = have - 12;
	size_t in_body = got < body ? got : body;
	memcpy(buf, reply_buf + 12, in_body);
	/* a table's status may carry a key (DM_SECURE_DATA_FLAG's wipe, done for
	 * every reply): no copy of the answer stays behind in this buffer */
	explicit_bzero(reply_buf + 12, in_body);
	if (in_body < body && read_all(fd, (char *)buf + in_body, body - in_body, 0))
		return -1;
	*early = reply_buf + 12 + in_body;
	*early_len = (uint32_t)(got - in_body);
	return 0;
}

/* The bytes of a request's buffer the frame carries: all of them for a
 * command that reads what follows the header (dmioctl.rs Cmd::reads_data: a
 * rename, a table load, a message, a geometry, a target version's name) and for
 * dmkit's own requests; the header alone for the others, which only write
 * there (libdevmapper's buffers are 16 KiB: carrying them to be filled would
 * copy them three times more per ioctl). */
#define HEADER_SIZE 312u
static uint32_t carried(uint32_t request, uint32_t len)
{
	if (((request >> 8) & 0xff) != 0xfd)
		return len;
	switch (request & 0xff) {
	case 5:  /* DEV_RENAME */
	case 9:  /* TABLE_LOAD */
	case 14: /* TARGET_MSG */
	case 15: /* DEV_SET_GEOMETRY */
	case 17: /* GET_TARGET_VERSION */
		return len;
	default:
		return len < HEADER_SIZE ? len : HEADER_SIZE;
	}
}

#define DM_DEV_WAIT_NR 8u
#define DM_DEV_ARM_POLL_NR 16u
#define DM_TABLE_LOAD_NR 9u
/* door.rs POLL_NOTICE: the daemon's frame for an event on an armed descriptor */
#define POLL_NOTICE 0x7fffdc02

static int exchange_on(int fd, int own, uint32_t request, void *buf, uint32_t len, int quiet);

static void drop_thread_conn(void)
{
	if (thread_conn >= 0) {
		ours[thread_conn] = 0;
		get_close()(thread_conn);
	}
	thread_conn = -1;
}

/*
 * One request to the daemon, on this thread's connection: `len` bytes of `buf`
 * out, the reply copied back over them. Returns the errno (0: success; EIO: the
 * daemon went away). The daemon's reason for a refusal goes to stderr unless
 * `quiet` (ENXIO, "no such device", is an answer, not a failure: libdevmapper
 * asks it to learn a device does not exist). A DEV_WAIT interrupted by a signal
 * returns EINTR, as the kernel's: the connection is dropped, so the daemon stops
 * waiting for the caller (dmeventd interrupts its waiting threads this way).
 */
static int exchange(uint32_t request, void *buf, uint32_t len, int quiet)
{
	if (thread_conn >= 0 && ours[thread_conn] != CONN) {
		/* closed under us (a daemon closing every descriptor): the number may
		 * be another file's now, so it is only forgotten */
		thread_conn = -1;
	}
	if (thread_conn >= 0 && thread_pid != getpid()) {
		/* a forked child's copy of its parent's connection: not its own */
		ours[thread_conn] = 0;
		get_close()(thread_conn);
		thread_conn = -1;
	}
	if (thread_conn < 0) {
		int c = open_door(O_CLOEXEC);
		if (c < 0)
			return EIO;
		ours[c] = CONN;
		thread_conn = c;
		thread_pid = getpid();
		pthread_once(&conn_once, conn_key_init);
		pthread_setspecific(conn_key, (void *)(intptr_t)(c + 1));
	}
	return exchange_on(thread_conn, 1, request, buf, len, quiet);
}

/* A request on connection `fd`; `own`: the thread's connection (dropped when it
 * fails), else the program's control descriptor (an armed one: notices of
 * events that came before the reply are skipped). */
static int exchange_on(int fd, int own, uint32_t request, void *buf, uint32_t len, int quiet)
{
	/* the working directory, for the relative paths of a table */
	char cwd[4096];
	cwd[0] = 0;
	if ((request & 0xff) == DM_TABLE_LOAD_NR && !getcwd(cwd, sizeof(cwd)))
		cwd[0] = 0;
	uint32_t head[4] = {request, len, carried(request, len), (uint32_t)strlen(cwd)};
	int32_t rep[3] = {0, 0, 0};
	int err = 0;
	int waits = ((request & 0xff) == DM_DEV_WAIT_NR) && ((request >> 8) & 0xff) == 0xfd;
	int r = 0;
	int failed = send_frame(fd, head, buf, head[2], cwd, head[3]);
	/* the reason's bytes that came with the reply (see read_reply) */
	const char *early = NULL;
	uint32_t early_len = 0;
	if (!failed && own && !waits) {
		r = read_reply(fd, rep, buf, len, &early, &early_len);
	} else {
		while (!failed && !(r = read_all(fd, rep, sizeof(rep), waits)) && rep[0] == POLL_NOTICE &&
		       rep[1] == 0 && rep[2] == 0)
			; /* an event's notice, sent before the reply */
		if (!failed && !r && ((uint32_t)rep[1] > len || read_all(fd, buf, (uint32_t)rep[1], 0)))
			r = -1;
	}
	if (failed || r) {
		if (own)
			drop_thread_conn();
		if (r == -2)
			return EINTR;
		err = EIO;
	} else {
		err = rep[0];
		int show = !quiet && rep[0] != ENXIO && rep[2] != 0;
		uint32_t why = (uint32_t)rep[2];
		char msg[512];
		if (show)
			fputs("dmkit: ", stderr);
		if (early_len) {
			if (show)
				fwrite(early, 1, early_len, stderr);
			why -= early_len;
		}
		while (why) {
			uint32_t k = why < sizeof(msg) ? why : (uint32_t)sizeof(msg);
			if (read_all(fd, msg, k, 0)) {
				if (own)
					drop_thread_conn();
				err = EIO;
				break;
			}
			if (show)
				fwrite(msg, 1, k, stderr);
			why -= k;
		}
		if (show)
			fputc('\n', stderr);
	}
	if (err == EIO && rep[0] != EIO)
		fprintf(stderr, "dmkit: the dmkit daemon at %s went away\n", door_socket);
	return err;
}

/* One dm ioctl through the daemon, on a buffer of data_size bytes as the
 * kernel copies them (the header alone when data_size is out of range: the
 * daemon refuses it as the kernel does), of which the frame carries what the
 * command reads (carried()). */
static int door_ioctl(int fd, unsigned long request, void *arg)
{
	if (((request >> 8) & 0xff) != 0xfd) {
		errno = ENOTTY;
		return -1;
	}
	if (!arg) {
		errno = EFAULT;
		return -1;
	}
	uint32_t data_size;
	memcpy(&data_size, (char *)arg + 12, 4);
	uint32_t len = (data_size >= MIN_DATA_SIZE && data_size <= BUFFER_LIMIT) ? data_size : MIN_DATA_SIZE;
	int e;
	if ((request & 0xff) == DM_DEV_ARM_POLL_NR) {
		/* On the program's descriptor itself, the one it polls: the notices
		 * of events before this arming are dropped, and from the reply on the
		 * daemon sends one when an event happens, which makes the descriptor
		 * readable (POLLIN), as the kernel's control node is after an event. */
		int32_t n[3];
		while (recv(fd, n, sizeof(n), MSG_DONTWAIT | MSG_PEEK) == (ssize_t)sizeof(n) && n[0] == POLL_NOTICE)
			if (recv(fd, n, sizeof(n), MSG_DONTWAIT) != (ssize_t)sizeof(n))
				break;
		e = exchange_on(fd, 0, (uint32_t)request, arg, len, 0);
	} else {
		e = exchange((uint32_t)request, arg, len, 0);
	}
	if (e) {
		errno = e;
		return -1;
	}
	return 0;
}

/* dmkit's read-ahead request (door.rs READ_AHEAD_REQUEST). */
#define READ_AHEAD_REQUEST 0xdc01u

/* /sys/dev/block/253:N/bdi/read_ahead_kb, where libdevmapper reads a device's
 * read-ahead: the daemon's device's (253 may be another driver's major here). */
/* A memory file holding `text`, as a sysfs attribute reads. */
static int text_fd(const char *name, const char *text)
{
	int out = memfd_create(name, MFD_CLOEXEC);
	if (out < 0)
		return -1;
	size_t k = strlen(text);
	if (write(out, text, k) != (ssize_t)k) {
		get_close()(out);
		errno = EIO;
		return -1;
	}
	lseek(out, 0, SEEK_SET);
	return out;
}

/* /sys/dev/block/253:N/dm/{name,uuid,suspended}: the daemon's device's, from
 * DM_DEV_STATUS by number (libdevmapper and LVM read them to name a device and
 * to know whether it is suspended); -2 for other paths. */
static int sysfs_dm_fd(const char *path)
{
	unsigned maj, min;
	char attr[16];
	int n = 0;
	if (sscanf(path, "/sys/dev/block/%u:%u/dm/%15[a-z]%n", &maj, &min, attr, &n) != 3 || path[n] != 0 ||
	    maj != DM_MAJOR || (strcmp(attr, "name") && strcmp(attr, "uuid") && strcmp(attr, "suspended")))
		return -2;
	struct dm_ioctl io;
	memset(&io, 0, sizeof(io));
	io.version[0] = DM_VERSION_MAJOR;
	io.data_size = sizeof(io);
	io.data_start = sizeof(io);
	io.dev = makedev(maj, min);
	if (exchange((uint32_t)DM_DEV_STATUS, &io, sizeof(io), 1)) {
		errno = ENOENT;
		return -1;
	}
	char text[DM_UUID_LEN + 2];
	if (!strcmp(attr, "suspended"))
		snprintf(text, sizeof(text), "%d\n", (io.flags & DM_SUSPEND_FLAG) ? 1 : 0);
	else
		snprintf(text, sizeof(text), "%.*s\n", DM_UUID_LEN - 1, !strcmp(attr, "name") ? io.name : io.uuid);
	return text_fd(attr, text);
}

static int sysfs_fd(const char *path)
{
	unsigned maj, min;
	int n = 0;
	int dm = sysfs_dm_fd(path);
	if (dm != -2)
		return dm;
	if (sscanf(path, "/sys/dev/block/%u:%u/bdi/read_ahead_kb%n", &maj, &min, &n) != 2 || n == 0 ||
	    path[n] != 0 || maj != DM_MAJOR)
		return -2;
	uint64_t dev = makedev(maj, min);
	char b[8];
	memcpy(b, &dev, 8);
	int e = exchange(READ_AHEAD_REQUEST, b, 8, 1);
	if (e) {
		errno = ENOENT;
		return -1;
	}
	uint64_t sectors;
	memcpy(&sectors, b, 8);
	char line[32];
	snprintf(line, sizeof(line), "%llu\n", (unsigned long long)(sectors / 2));
	return text_fd("read_ahead_kb", line);
}

/* The block-device ioctls programs ask of a device, answered from its file. */
static int blk_ioctl(int fd, unsigned long request, void *arg)
{
	struct stat st;
	if (get_fstat()(fd, &st) != 0)
		return -1;
	uint64_t size = (uint64_t)st.st_size, range[2];
	switch (request) {
	case BLKGETSIZE64:
		memcpy(arg, &size, sizeof(size));
		return 0;
	case BLKGETSIZE: {
		unsigned long sectors = (unsigned long)(size >> 9);
		memcpy(arg, &sectors, sizeof(sectors));
		return 0;
	}
	case BLKSSZGET:
	case BLKPBSZGET:
	case BLKIOMIN:
	case BLKBSZGET: {
		/* the device's logical block size, an attribute of its file */
		char a[16] = {0};
		int lbs = 512;
		if (fgetxattr(fd, "user.dmkit.logical_block_size", a, sizeof(a) - 1) > 0 && atoi(a) >= 512)
			lbs = atoi(a);
		int v = request == BLKBSZGET && lbs < 4096 ? 4096 : lbs;
		memcpy(arg, &v, sizeof(v));
		return 0;
	}
	case BLKIOOPT:
	case BLKALIGNOFF:
	case BLKDISCARDZEROES: {
		int v = 0;
		memcpy(arg, &v, sizeof(v));
		return 0;
	}
	case BLKROGET: {
		int ro = (st.st_mode & 0200) == 0;
		memcpy(arg, &ro, sizeof(ro));
		return 0;
	}
	case BLKRAGET: {
		long ra = 256;
		memcpy(arg, &ra, sizeof(ra));
		return 0;
	}
	case BLKFLSBUF:
		return fsync(fd);
	case BLKDISCARD:
	case BLKZEROOUT:
		memcpy(range, arg, sizeof(range));
		if (range[0] > size || range[1] > size - range[0]) {
			errno = EINVAL;
			return -1;
		}
		return fallocate(fd,
				 request == BLKDISCARD ? FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE : FALLOC_FL_ZERO_RANGE,
				 (off_t)range[0], (off_t)range[1]);
	default:
		errno = ENOTTY;
		return -1;
	}
}

int ioctl(int fd, unsigned long request, ...)
{
	va_list ap;
	va_start(ap, request);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	if (is_ours(fd))
		return door_ioctl(fd, request, arg);
	if (is_blk(fd))
		return blk_ioctl(fd, request, arg);
	return get_ioctl()(fd, request, arg);
}

int close(int fd)
{
	if (fd >= 0 && fd < MAX_FD)
		ours[fd] = 0;
	if (is_blk(fd))
		blk_minor[fd] = 0;
	return get_close()(fd);
}

static void control_stat(struct stat *st)
{
	memset(st, 0, sizeof(*st));
	st->st_mode = S_IFCHR | 0600;
	st->st_rdev = makedev(MISC_MAJOR, DM_CONTROL_MINOR);
	st->st_nlink = 1;
	st->st_blksize = 4096;
}

/* A device file's stat, made the block device's: its node's number, no size. */
static int blk_stat(int fd, struct stat *st)
{
	uint32_t m = blk_minor[fd] - 1;
	st->st_mode = S_IFBLK | (st->st_mode & 07777);
	st->st_rdev = makedev(DM_MAJOR, m);
	st->st_size = 0;
	st->st_blocks = 0;
	st->st_blksize = 4096;
	return 0;
}

/* struct stat and struct stat64 are one layout on 64-bit Linux. */
_Static_assert(sizeof(struct stat) == sizeof(struct stat64), "stat64 layout");

/* A block device that is a dmkit device's block device: its device-mapper
 * number. Returns `rc` (the real call's result), for the stat wrappers. */
static int dm_number(int rc, struct stat *st)
{
	if (rc != 0 || !numbers_dir[0] || !S_ISBLK(st->st_mode) || major(st->st_rdev) == DM_MAJOR)
		return rc;
	char p[sizeof(numbers_dir) + 32], t[32];
	snprintf(p, sizeof(p), "%s/%u:%u", numbers_dir, major(st->st_rdev), minor(st->st_rdev));
	int e = errno;
	ssize_t n = readlink(p, t, sizeof(t) - 1);
	errno = e;
	unsigned maj, min;
	if (n > 0) {
		t[n] = 0;
		if (sscanf(t, "%u:%u", &maj, &min) == 2)
			st->st_rdev = makedev(maj, min);
	}
	return rc;
}

int stat(const char *path, struct stat *st)
{
	if (is_control(path)) {
		control_stat(st);
		return 0;
	}
	return dm_number(get_stat()(path, st), st);
}

int stat64(const char *path, struct stat64 *st)
{
	if (is_control(path)) {
		control_stat((struct stat *)st);
		return 0;
	}
	return dm_number(get_stat64()(path, st), (struct stat *)st);
}

int lstat(const char *path, struct stat *st)
{
	if (is_control(path)) {
		control_stat(st);
		return 0;
	}
	return dm_number(get_lstat()(path, st), st);
}

int lstat64(const char *path, struct stat64 *st)
{
	if (is_control(path)) {
		control_stat((struct stat *)st);
		return 0;
	}
	return dm_number(get_lstat64()(path, st), (struct stat *)st);
}

int fstat(int fd, struct stat *st)
{
	if (is_ours(fd)) {
		control_stat(st);
		return 0;
	}
	if (is_blk(fd))
		return get_fstat()(fd, st) != 0 ? -1 : blk_stat(fd, (struct stat *)st);
	return dm_number(get_fstat()(fd, st), st);
}

int fstat64(int fd, struct stat64 *st)
{
	if (is_ours(fd)) {
		control_stat((struct stat *)st);
		return 0;
	}
	if (is_blk(fd))
		return get_fstat64()(fd, st) != 0 ? -1 : blk_stat(fd, (struct stat *)st);
	return dm_number(get_fstat64()(fd, st), (struct stat *)st);
}

/* The entries binaries built against glibc before 2.33 call. */
int __xstat(int ver, const char *path, struct stat *st)
{
	if (is_control(path)) {
		control_stat(st);
		return 0;
	}
	return dm_number(get___xstat()(ver, path, st), st);
}

int __xstat64(int ver, const char *path, struct stat64 *st)
{
	if (is_control(path)) {
		control_stat((struct stat *)st);
		return 0;
	}
	return dm_number(get___xstat64()(ver, path, st), (struct stat *)st);
}

int __lxstat(int ver, const char *path, struct stat *st)
{
	if (is_control(path)) {
		control_stat(st);
		return 0;
	}
	return dm_number(get___lxstat()(ver, path, st), st);
}

int __lxstat64(int ver, const char *path, struct stat64 *st)
{
	if (is_control(path)) {
		control_stat((struct stat *)st);
		return 0;
	}
	return dm_number(get___lxstat64()(ver, path, st), (struct stat *)st);
}

int __fxstat(int ver, int fd, struct stat *st)
{
	if (is_ours(fd)) {
		control_stat(st);
		return 0;
	}
	if (is_blk(fd))
		return get___fxstat()(ver, fd, st) != 0 ? -1 : blk_stat(fd, (struct stat *)st);
	return dm_number(get___fxstat()(ver, fd, st), st);
}

int __fxstat64(int ver, int fd, struct stat64 *st)
{
	if (is_ours(fd)) {
		control_stat((struct stat *)st);
		return 0;
	}
	if (is_blk(fd))
		return get___fxstat64()(ver, fd, st) != 0 ? -1 : blk_stat(fd, (struct stat *)st);
	return dm_number(get___fxstat64()(ver, fd, st), (struct stat *)st);
}
