/*
 * dmkit's door for unmodified programs: preloaded by `dmkit exec`, it makes the
 * device-mapper control node reach the dmkit daemon (see src/control/preload.rs
 * for why this is C). Everything that is not dmkit's goes to libc untouched.
 *
 * What is dmkit's, and how it is known:
 *  - the control node, /dev/mapper/control or $DM_DEV_DIR/mapper/control (by
 *    path): its open is a socket connected to $DMKIT_DOOR_SOCKET, one per open,
 *    as the kernel's one file per open; that descriptor is known by the socket's
 *    inode, checked at each use, so a number the program closed (close_range,
 *    dup2 over it, fclose, a daemon closing everything) and opened again as
 *    another file is that file;
 *  - dmkit's block nodes: block major $DMKIT_RUN_DIR/major, a major the kernel
 *    never gives out (src/mapper/mod.rs `Major`), under /dev or $DM_DEV_DIR; and
 *    /dev/mapper/NAME where the host has no such node and the daemon has a device
 *    NAME. Their open is the device's file, $DMKIT_DEVICE_FILES/MAJOR:MINOR,
 *    which the daemon serves (src/export/files.rs). A descriptor is a device's
 *    by what fstat says of it (a regular file of that FUSE mount, its inode
 *    naming the minor), never by its number: on it fstat says it is the block
 *    device and the block-device ioctls (size, sector sizes, read-only, flush,
 *    discard, zeroing) are answered from the file;
 *  - /proc/devices and /proc/misc (fopen and open): the kernel's text with
 *    dmkit's `device-mapper` line in place of the kernel's, where libdevmapper
 *    and LVM read them (libdevmapper takes the first such line, LVM the last:
 *    with two, they would disagree);
 *  - /sys/dev/block/MAJOR:N/{dm/name,dm/uuid,dm/suspended,bdi/read_ahead_kb}
 *    and the link /sys/dev/block/MAJOR:N itself (readlink), for dmkit's major
 *    only;
 *  - stat of a node that is a dmkit device's ublk block device (as
 *    /dev/mapper/NAME is under `serve --attach`): the device-mapper number,
 *    from $DMKIT_RUN_DIR/block-numbers, so that libdevmapper and LVM see one
 *    device; its I/O goes to the kernel's block device.
 * The kernel's device-mapper nodes (major 253 or wherever it is), zram's and
 * every other device pass through: a program behind the door opens them as
 * without it.
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
#include <sys/statfs.h>
#include <stdatomic.h>
#include <sys/uio.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/xattr.h>
#include <unistd.h>

/* dmkit's block major when the run directory names none (mapper::Major) */
#define PREFERRED_MAJOR 511
#define MISC_MAJOR 10
/* src/export/files.rs: a device file's inode is this plus its minor */
#define DEV_INO (1ull << 32)
#define FUSE_SUPER_MAGIC 0x65735546
#define DM_CONTROL_MINOR 236
#define MIN_DATA_SIZE 305u
#define BUFFER_LIMIT (64u << 20)
#define MAX_FD 65536

static char door_socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
static char files_dir[4096];
static const char *files_error;
static char dev_dir[4096];
static char control_alt[4096];
/* $DMKIT_RUN_DIR/block-numbers: MAJOR:MINOR -> MAJOR:N for attached devices */
static char numbers_dir[4096];
static unsigned dm_major = PREFERRED_MAJOR;
/* The device files' mount (its st_dev), found at the first need; 0: none. */
static dev_t files_dev;
static pthread_once_t files_once = PTHREAD_ONCE_INIT;

/*
 * The sockets this library connected, by descriptor: kind (CONTROL: a
 * program's open of the control node; CONN: a thread's own connection) and the
 * socket's inode. Written and read by any thread (atomics); an entry is trusted
 * only after fstat shows the descriptor is still that socket.
 */
#define CONTROL 1
#define CONN 2
static _Atomic unsigned char fd_kind[MAX_FD];
static _Atomic uint64_t fd_ino[MAX_FD];
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

static int checked_kind(int fd, int kind);
static int (*get_close(void))(int);

/* A thread's connection goes with the thread (if the number is still it). */
static void conn_gone(void *v)
{
	free(reply_buf);
	reply_buf = NULL;
	reply_cap = 0;
	int fd = (int)(intptr_t)v - 1;
	if (fd >= 0 && thread_conn == fd && checked_kind(fd, CONN)) {
		atomic_store(&fd_kind[fd], 0);
		get_close()(fd);
	}
	thread_conn = -1;
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
REAL(int, dup, (int))
REAL(int, dup2, (int, int))
REAL(int, dup3, (int, int, int))
REAL(int, fcntl, (int, int, ...))
REAL(int, fcntl64, (int, int, ...))
REAL(int, fstatat, (int, const char *, struct stat *, int))
REAL(int, fstatat64, (int, const char *, struct stat64 *, int))
REAL(int, statx, (int, const char *, int, unsigned int, struct statx *))
REAL(int, unlink, (const char *))
REAL(int, rename, (const char *, const char *))
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
REAL(ssize_t, readlink, (const char *, char *, size_t))
REAL(ssize_t, readlinkat, (int, const char *, char *, size_t))
REAL(ssize_t, __readlink_chk, (const char *, char *, size_t, size_t))
REAL(ssize_t, __readlinkat_chk, (int, const char *, char *, size_t, size_t))

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
	if (r) {
		char p[4200], t[32];
		snprintf(p, sizeof(p), "%s/major", r);
		int fd = get_open()(p, O_RDONLY | O_CLOEXEC);
		if (fd >= 0) {
			ssize_t n = read(fd, t, sizeof(t) - 1);
			get_close()(fd);
			unsigned m;
			if (n > 0 && (t[n] = 0, sscanf(t, "%u", &m) == 1) && m > 0 && m < 4096)
				dm_major = m;
		}
	}
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

/* Descriptor `fd` is a socket of this library's of `kind` (checked by its
 * inode; an entry that no longer matches is forgotten). `seen`: its fstat, if
 * the caller has just taken it (else it is taken here). */
static int known_socket(int fd, int kind, const struct stat *seen)
{
	if (fd < 0 || fd >= MAX_FD)
		return 0;
	unsigned char k = atomic_load(&fd_kind[fd]);
	if (k != kind)
		return 0;
	uint64_t ino = atomic_load(&fd_ino[fd]);
	struct stat st;
	int e = errno;
	if (!seen && get_fstat()(fd, &st) == 0)
		seen = &st;
	int same = seen && S_ISSOCK(seen->st_mode) && (uint64_t)seen->st_ino == ino;
	errno = e;
	if (!same) {
		atomic_compare_exchange_strong(&fd_kind[fd], &k, 0);
		return 0;
	}
	return 1;
}

static int checked_kind(int fd, int kind)
{
	return known_socket(fd, kind, NULL);
}

static int is_ours(int fd)
{
	return checked_kind(fd, CONTROL);
}

/* Remember `fd` as a socket of `kind`. */
static void track(int fd, int kind)
{
	struct stat st;
	if (fd < 0 || fd >= MAX_FD || get_fstat()(fd, &st) != 0)
		return;
	atomic_store(&fd_kind[fd], 0);
	atomic_store(&fd_ino[fd], (uint64_t)st.st_ino);
	atomic_store(&fd_kind[fd], (unsigned char)kind);
}

/* `to` was made a duplicate of `from` (dup, dup2, dup3, F_DUPFD): a duplicate
 * of a control descriptor is one too; whatever `to` was is forgotten. */
static void track_dup(int from, int to)
{
	if (to < 0 || to >= MAX_FD || from == to)
		return;
	atomic_store(&fd_kind[to], 0);
	if (checked_kind(from, CONTROL))
		track(to, CONTROL);
}

/* The device files' mount, if it is one: a FUSE filesystem at files_dir. */
static void find_files_dev(void)
{
	struct stat st;
	struct statfs fs;
	int e = errno;
	if (files_dir[0] && get_stat()(files_dir, &st) == 0 && statfs(files_dir, &fs) == 0 &&
	    (unsigned long)fs.f_type == FUSE_SUPER_MAGIC)
		files_dev = st.st_dev;
	errno = e;
}

/* The minor of the dmkit device whose file `st` describes, or -1. */
static long device_file_minor(const struct stat *st)
{
	if (!S_ISREG(st->st_mode) || !files_dir[0])
		return -1;
	pthread_once(&files_once, find_files_dev);
	if (!files_dev || st->st_dev != files_dev || (uint64_t)st->st_ino < DEV_INO ||
	    (uint64_t)st->st_ino - DEV_INO >= (1u << 20))
		return -1;
	return (long)((uint64_t)st->st_ino - DEV_INO);
}

static int open_door(int flags, int quiet)
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
		if (!quiet)
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
	track(fd, CONTROL);
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
	int added = 0, block = 0, failed = 0;
	int k = misc ? snprintf(line, sizeof(line), "%3d device-mapper\n", DM_CONTROL_MINOR)
		     : snprintf(line, sizeof(line), "%3u device-mapper\n", dm_major);
	for (char *l = text; *l && !failed;) {
		char *end = strchr(l, '\n');
		size_t len = end ? (size_t)(end - l) + 1 : strlen(l);
		int dm = len >= 14 && memcmp(l + len - (end ? 14 : 13), "device-mapper", 13) == 0;
		if (misc) {
			/* the kernel's control node, where dm is loaded: the same minor */
			added |= dm;
		} else if (block && !added && (len <= 1 || (unsigned)atoi(l) > dm_major)) {
			/* dmkit's line where its major sorts, or at the section's end */
			failed = write(out, line, (size_t)k) < 0;
			added = 1;
		}
		/* the kernel's device-mapper block major is not the one behind the door */
		if (!(block && dm) && write(out, l, len) < 0)
			failed = 1;
		if (!misc && len >= 14 && strncmp(l, "Block devices:", 14) == 0)
			block = 1;
		l += len;
	}
	if (!failed && !added) {
		if (!misc && !block && write(out, "\nBlock devices:\n", 16) < 0)
			failed = 1;
		if (!failed && write(out, line, (size_t)k) < 0)
			failed = 1;
	}
	/* on a failed write the file is shorter; the reader finds no line */
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

/* Where device nodes are: /dev, or $DM_DEV_DIR. */
static int under_dev(const char *path)
{
	return strncmp(path, "/dev/", 5) == 0 || (dev_dir[0] && strncmp(path, dev_dir, strlen(dev_dir)) == 0);
}

static int exchange(uint32_t request, void *buf, uint32_t len, int quiet);

/* DM_DEV_STATUS of the device `name` (or, with no name, of number `dev`) into
 * `io`, quietly: 0, or the errno. */
static int dev_status(struct dm_ioctl *io, const char *name, uint64_t dev)
{
	memset(io, 0, sizeof(*io));
	io->version[0] = DM_VERSION_MAJOR;
	io->data_size = sizeof(*io);
	io->data_start = sizeof(*io);
	if (name)
		memcpy(io->name, name, strlen(name) + 1);
	io->dev = dev;
	return exchange((uint32_t)DM_DEV_STATUS, io, sizeof(*io), 1);
}

/* A kernel dev_t as dm_ioctl carries it (huge_encode_dev): its minor. */
static long dm_dev_minor(uint64_t dev)
{
	return (long)((dev & 0xff) | ((dev >> 12) & 0xfff00));
}

/*
 * /dev/mapper/NAME where the host has nothing of that name: the minor of
 * dmkit's device NAME, or -1 (no such device, or the host has the path: the
 * host's node wins). So a user can type /dev/mapper/NAME behind the door for a
 * device however it was made, and nothing is created in the host's /dev.
 */
static long mapper_name_minor(const char *path)
{
	if (!path || strncmp(path, "/dev/", 5) != 0 || !door_socket[0] || !files_dir[0])
		return -1;
	char target[4096];
	if (strncmp(path, "/dev/mapper/", 12) != 0) {
		/* a link to one, as LVM makes /dev/VG/LV (absolute, or relative to
		 * its directory) */
		int e = errno;
		ssize_t n = readlink(path, target, sizeof(target) - 1);
		errno = e;
		if (n <= 0)
			return -1;
		target[n] = 0;
		const char *rel = target;
		while (!strncmp(rel, "../", 3))
			rel += 3;
		if (target[0] != '/' && !strncmp(rel, "mapper/", 7) && rel != target) {
			memmove(target + 5, rel, strlen(rel) + 1);
			memcpy(target, "/dev/", 5);
		}
		if (strncmp(target, "/dev/mapper/", 12) != 0)
			return -1;
		path = target;
	}
	const char *name = path + 12;
	if (!*name || strchr(name, '/') || strlen(name) >= DM_NAME_LEN || !strcmp(name, "control") ||
	    !strcmp(name, ".") || !strcmp(name, ".."))
		return -1;
	struct stat st;
	int e = errno;
	if (get_lstat()(path, &st) == 0 || errno != ENOENT) {
		errno = e;
		return -1;
	}
	struct dm_ioctl io;
	long m = dev_status(&io, name, 0) == 0 ? dm_dev_minor(io.dev) : -1;
	errno = e;
	return m;
}

/* The minor of the dmkit block node `path` names (following links), or -1.
 * Nodes are named by absolute paths under /dev or $DM_DEV_DIR. */
static long dm_node_minor(const char *path)
{
	struct stat st;
	if (!path || path[0] != '/' || !under_dev(path))
		return -1;
	int e = errno;
	if (get_stat()(path, &st) != 0) {
		errno = e;
		return mapper_name_minor(path);
	}
	if (!S_ISBLK(st.st_mode) || major(st.st_rdev) != dm_major)
		return -1;
	return (long)minor(st.st_rdev);
}

/* A dmkit device's node: its file instead (-2 when `path` is not one). */
static int open_device_file(const char *path, int flags, mode_t mode)
{
	long m = dm_node_minor(path);
	if (m < 0)
		return -2;
	if (!files_dir[0]) {
		static atomic_int told;
		if (files_error && !atomic_exchange(&told, 1))
			fprintf(stderr, "dmkit: %s is a dmkit device, but its file is not served: %s\n", path,
				files_error);
		errno = ENXIO; /* no driver has dmkit's major */
		return -1;
	}
	char file[sizeof(files_dir) + 32];
	snprintf(file, sizeof(file), "%s/%u:%ld", files_dir, dm_major, m);
	int fd = get_open()(file, flags & ~(O_CREAT | O_EXCL | O_TRUNC), mode);
	if (fd < 0 && errno == ENOENT)
		errno = ENXIO; /* a node left by a removed device */
	return fd;
}

static int open_common(int dirfd, const char *path, int flags, mode_t mode)
{
	if (is_control(path))
		return open_door(flags, 0);
	int fd = special_fd(path);
	if (fd != -2)
		return fd;
	(void)dirfd; /* nodes are named by absolute paths */
	return open_device_file(path, flags, mode);
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

int __openat_2(int dirfd, const char *path, int flags)
{
	return openat(dirfd, path, flags);
}

int __openat64_2(int dirfd, const char *path, int flags)
{
	return openat64(dirfd, path, flags);
}

/* fopen's mode as open's flags. */
static int mode_flags(const char *mode)
{
	int flags = O_RDONLY;
	if (mode[0] == 'w' || mode[0] == 'a')
		flags = O_WRONLY;
	for (const char *m = mode + 1; *m; m++) {
		if (*m == '+')
			flags = (flags & ~O_ACCMODE) | O_RDWR;
		else if (*m == 'e')
			flags |= O_CLOEXEC;
	}
	return flags;
}

/* glibc's fopen opens without the open symbol, so the door's paths are
 * answered here too: the synthetic files, and dmkit's device nodes. */
static FILE *fopen_common(const char *path, const char *mode, FILE *(*real)(const char *, const char *))
{
	int fd = special_fd(path);
	const char *fmode = "r";
	if (fd == -2 && path && mode) {
		fd = open_device_file(path, mode_flags(mode), 0);
		fmode = mode;
	}
	if (fd == -2)
		return real(path, mode);
	if (fd < 0)
		return NULL;
	FILE *f = fdopen(fd, fmode);
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

/* This thread's connection is done with: closed if the number is still it
 * (never a descriptor that has become the program's). */
static void drop_thread_conn(void)
{
	if (thread_conn >= 0 && checked_kind(thread_conn, CONN)) {
		atomic_store(&fd_kind[thread_conn], 0);
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
	if (thread_conn >= 0 && !checked_kind(thread_conn, CONN)) {
		/* closed under us (a daemon closing every descriptor): the number may
		 * be another file's now, so it is only forgotten */
		thread_conn = -1;
	}
	if (thread_conn >= 0 && thread_pid != getpid()) {
		/* a forked child's copy of its parent's connection: not its own */
		drop_thread_conn();
	}
	if (thread_conn < 0) {
		int c = open_door(O_CLOEXEC, quiet);
		if (c < 0)
			return EIO;
		track(c, CONN);
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

/* /sys/dev/block/MAJOR:N/bdi/read_ahead_kb, where libdevmapper reads a device's
 * read-ahead: the daemon's device's. */
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

/* /sys/dev/block/MAJOR:N/dm/{name,uuid,suspended}: the daemon's device's, from
 * DM_DEV_STATUS by number (libdevmapper and LVM read them to name a device and
 * to know whether it is suspended); -2 for other paths. */
static int sysfs_dm_fd(const char *path)
{
	unsigned maj, min;
	char attr[16];
	int n = 0;
	if (sscanf(path, "/sys/dev/block/%u:%u/dm/%15[a-z]%n", &maj, &min, attr, &n) != 3 || path[n] != 0 ||
	    maj != dm_major || (strcmp(attr, "name") && strcmp(attr, "uuid") && strcmp(attr, "suspended")))
		return -2;
	struct dm_ioctl io;
	if (dev_status(&io, NULL, makedev(maj, min))) {
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
	    path[n] != 0 || maj != dm_major)
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

/* readlink of /sys/dev/block/MAJOR:N, MAJOR dmkit's: the kernel's link to the
 * device's dm-N, where cryptsetup finds the node of a device a table names
 * (a crypt device's integrity device below it); ENOENT if the daemon has no
 * such device. -2 for any other path. */
static ssize_t sysfs_link(const char *path, char *buf, size_t size)
{
	unsigned maj, min;
	int n = 0;
	if (!path || !door_socket[0] || strncmp(path, "/sys/dev/block/", 15) != 0 ||
	    sscanf(path, "/sys/dev/block/%u:%u%n", &maj, &min, &n) != 2 || path[n] != 0 || maj != dm_major)
		return -2;
	struct dm_ioctl io;
	if (dev_status(&io, NULL, makedev(maj, min))) {
		errno = ENOENT;
		return -1;
	}
	char t[64];
	int k = snprintf(t, sizeof(t), "../../devices/virtual/block/dm-%u", min);
	size_t c = (size_t)k < size ? (size_t)k : size;
	memcpy(buf, t, c);
	return (ssize_t)c;
}

ssize_t readlink(const char *path, char *buf, size_t size)
{
	ssize_t r = sysfs_link(path, buf, size);
	return r != -2 ? r : get_readlink()(path, buf, size);
}

ssize_t readlinkat(int dirfd, const char *path, char *buf, size_t size)
{
	ssize_t r = sysfs_link(path, buf, size);
	return r != -2 ? r : get_readlinkat()(dirfd, path, buf, size);
}

/* The _FORTIFY_SOURCE entry points: a size past the buffer goes to libc's,
 * which ends the program as it would without the door. */
ssize_t __readlink_chk(const char *path, char *buf, size_t size, size_t buflen)
{
	ssize_t r = size <= buflen ? sysfs_link(path, buf, size) : -2;
	return r != -2 ? r : get___readlink_chk()(path, buf, size, buflen);
}

ssize_t __readlinkat_chk(int dirfd, const char *path, char *buf, size_t size, size_t buflen)
{
	ssize_t r = size <= buflen ? sysfs_link(path, buf, size) : -2;
	return r != -2 ? r : get___readlinkat_chk()(dirfd, path, buf, size, buflen);
}

/* The block-device ioctls answered for a device's file; any other request on
 * any descriptor goes to libc untouched, without a look at the descriptor. */
static int blk_request(unsigned long request)
{
	switch (request) {
	case BLKGETSIZE64:
	case BLKGETSIZE:
	case BLKSSZGET:
	case BLKPBSZGET:
	case BLKIOMIN:
	case BLKBSZGET:
	case BLKIOOPT:
	case BLKALIGNOFF:
	case BLKDISCARDZEROES:
	case BLKROGET:
	case BLKRAGET:
	case BLKFLSBUF:
	case BLKDISCARD:
	case BLKZEROOUT:
		return 1;
	default:
		return 0;
	}
}

/* A block-device ioctl on a device's file (`st`: its fstat, just taken). */
static int blk_ioctl(int fd, unsigned long request, void *arg, const struct stat *st)
{
	uint64_t size = (uint64_t)st->st_size, range[2];
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
		int ro = (st->st_mode & 0200) == 0;
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
	if (blk_request(request)) {
		struct stat st;
		int e = errno;
		if (get_fstat()(fd, &st) == 0 && device_file_minor(&st) >= 0)
			return blk_ioctl(fd, request, arg, &st);
		errno = e;
	}
	return get_ioctl()(fd, request, arg);
}

int close(int fd)
{
	if (fd >= 0 && fd < MAX_FD)
		atomic_store(&fd_kind[fd], 0);
	return get_close()(fd);
}

int dup(int fd)
{
	int r = get_dup()(fd);
	if (r >= 0)
		track_dup(fd, r);
	return r;
}

int dup2(int fd, int to)
{
	int r = get_dup2()(fd, to);
	if (r >= 0)
		track_dup(fd, r);
	return r;
}

int dup3(int fd, int to, int flags)
{
	int r = get_dup3()(fd, to, flags);
	if (r >= 0)
		track_dup(fd, r);
	return r;
}

/* fcntl's third argument is an int or a pointer by command; passed on as a
 * pointer-sized word, as glibc's own fcntl reads it. */
#define FCNTL_BODY(real)                                       \
	va_list ap;                                                \
	va_start(ap, cmd);                                         \
	void *arg = va_arg(ap, void *);                            \
	va_end(ap);                                                \
	int r = real(fd, cmd, arg);                                \
	if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC)) \
		track_dup(fd, r);                                      \
	return r;

int fcntl(int fd, int cmd, ...)
{
	FCNTL_BODY(get_fcntl())
}

int fcntl64(int fd, int cmd, ...)
{
	FCNTL_BODY((get_fcntl64() ? get_fcntl64() : get_fcntl()))
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
static void blk_stat(long minor_no, struct stat *st)
{
	st->st_mode = S_IFBLK | (st->st_mode & 07777);
	st->st_rdev = makedev(dm_major, (unsigned)minor_no);
	st->st_size = 0;
	st->st_blocks = 0;
	st->st_blksize = 4096;
}

/* struct stat and struct stat64 are one layout on 64-bit Linux. */
_Static_assert(sizeof(struct stat) == sizeof(struct stat64), "stat64 layout");

/* A block device that is a dmkit device's block device: its device-mapper
 * number. Returns `rc` (the real call's result), for the stat wrappers. */
static int dm_number(int rc, struct stat *st)
{
	if (rc != 0 || !numbers_dir[0] || !S_ISBLK(st->st_mode) || major(st->st_rdev) == dm_major)
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

/* A path's stat behind the door: the control node's, /dev/mapper/NAME's for a
 * dmkit device the host has no node for, else the real one (`rc`, done by the
 * caller) with a ublk device's number made its device-mapper one. */
static int path_stat(const char *path, int rc, struct stat *st)
{
	if (rc != 0 && errno == ENOENT) {
		long m = mapper_name_minor(path);
		if (m >= 0) {
			memset(st, 0, sizeof(*st));
			st->st_mode = S_IFBLK | 0660;
			st->st_rdev = makedev(dm_major, (unsigned)m);
			st->st_nlink = 1;
			st->st_blksize = 4096;
			st->st_ino = (ino_t)(DEV_INO + (uint64_t)m);
			return 0;
		}
	}
	return dm_number(rc, st);
}


/* A descriptor's stat behind the door (`rc`: the real call's result). */
static int fd_stat(int fd, int rc, struct stat *st)
{
	if (rc != 0)
		return rc;
	if (known_socket(fd, CONTROL, st)) {
		control_stat(st);
		return 0;
	}
	long m = device_file_minor(st);
	if (m >= 0) {
		blk_stat(m, st);
		return 0;
	}
	return dm_number(rc, st);
}

#define PATH_STAT(real)                               \
	if (is_control(path)) {                                    \
		control_stat((struct stat *)st);                       \
		return 0;                                              \
	}                                                          \
	int rc = real;                                             \
	return path_stat(path, rc, (struct stat *)st);

int stat(const char *path, struct stat *st)
{
	PATH_STAT(get_stat()(path, st))
}

int stat64(const char *path, struct stat64 *st)
{
	PATH_STAT(get_stat64()(path, st))
}

int lstat(const char *path, struct stat *st)
{
	PATH_STAT(get_lstat()(path, st))
}

int lstat64(const char *path, struct stat64 *st)
{
	PATH_STAT(get_lstat64()(path, st))
}

int fstat(int fd, struct stat *st)
{
	return fd_stat(fd, get_fstat()(fd, st), st);
}

int fstat64(int fd, struct stat64 *st)
{
	return fd_stat(fd, get_fstat64()(fd, st), (struct stat *)st);
}

/* A path's first byte (-1: none; glibc declares the path non-null, which a
 * caller need not honour). */
__attribute__((noinline)) static int first_char(const char *p)
{
	return p ? (unsigned char)p[0] : -1;
}

/* fstatat of an absolute path is a stat (or lstat) of it; of "" with
 * AT_EMPTY_PATH an fstat of the descriptor; others are the real call's. */
#define AT_STAT(real)                                                   \
	int c = first_char(path);                                          \
	if (c == 0 && (flags & AT_EMPTY_PATH))                             \
		return fd_stat(dirfd, real, (struct stat *)st);                \
	if (c == '/') {                                                    \
		if (is_control(path)) {                                        \
			control_stat((struct stat *)st);                           \
			return 0;                                                  \
		}                                                              \
		return path_stat(path, real, (struct stat *)st);               \
	}                                                                  \
	return real;

int fstatat(int dirfd, const char *path, struct stat *st, int flags)
{
	AT_STAT(get_fstatat()(dirfd, path, st, flags))
}

int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags)
{
	AT_STAT(get_fstatat64()(dirfd, path, st, flags))
}

/*
 * A /dev/mapper/NAME that is there only behind the door (no node; a dmkit
 * device NAME) is removed and renamed as a no-op that succeeds. LVM points
 * libdevmapper at /dev for its nodes; libdevmapper, which makes, renames and
 * removes them itself without udev, sees the node there by stat (so it makes
 * none in the host's /dev), and would fail an lvremove or lvrename on a node it
 * cannot unlink or rename. Any other path is the real call's.
 */
int unlink(const char *path)
{
	int rc = get_unlink()(path);
	/* (ENOENT: the path was read, so it is not null) */
	if (rc != 0 && errno == ENOENT && !strncmp(path, "/dev/mapper/", 12) && mapper_name_minor(path) >= 0)
		return 0;
	return rc;
}

int rename(const char *from, const char *to)
{
	int rc = get_rename()(from, to);
	if (rc != 0 && errno == ENOENT && !strncmp(from, "/dev/mapper/", 12) && !strncmp(to, "/dev/mapper/", 12) &&
	    mapper_name_minor(to) >= 0)
		return 0;
	return rc;
}

/* `st`'s answers in `stx` (what the stat calls change: type, number, size). */
static void stx_from_stat(struct statx *stx, const struct stat *st)
{
	stx->stx_mode = (uint16_t)st->st_mode;
	stx->stx_ino = (uint64_t)st->st_ino;
	stx->stx_rdev_major = major(st->st_rdev);
	stx->stx_rdev_minor = minor(st->st_rdev);
	stx->stx_size = (uint64_t)st->st_size;
	stx->stx_blocks = (uint64_t)st->st_blocks;
	stx->stx_blksize = (uint32_t)st->st_blksize;
}

/* statx (coreutils' stat and ls): the same answers as the stat calls, in its
 * own structure. */
int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *stx)
{
	int c = first_char(path);
	struct stat st;
	if (c == '/' && is_control(path)) {
		control_stat(&st);
		memset(stx, 0, sizeof(*stx));
		stx->stx_mask = STATX_BASIC_STATS;
		stx->stx_nlink = 1;
		stx_from_stat(stx, &st);
		return 0;
	}
	int rc = get_statx()(dirfd, path, flags, mask, stx);
	if (rc == 0 && (c == '/' || (c == 0 && (flags & AT_EMPTY_PATH)))) {
		/* what the stat calls would say of it, from the same fields */
		memset(&st, 0, sizeof(st));
		st.st_mode = stx->stx_mode;
		st.st_dev = makedev(stx->stx_dev_major, stx->stx_dev_minor);
		st.st_ino = (ino_t)stx->stx_ino;
		st.st_rdev = makedev(stx->stx_rdev_major, stx->stx_rdev_minor);
		st.st_size = (off_t)stx->stx_size;
		st.st_blocks = (blkcnt_t)stx->stx_blocks;
		st.st_blksize = (blksize_t)stx->stx_blksize;
		struct stat before = st;
		if (c == 0)
			fd_stat(dirfd, 0, &st);
		else
			dm_number(0, &st);
		if (memcmp(&st, &before, sizeof(st)) != 0)
			stx_from_stat(stx, &st);
	} else if (rc != 0 && c == '/' && errno == ENOENT && path_stat(path, -1, &st) == 0) {
		memset(stx, 0, sizeof(*stx));
		stx->stx_mask = STATX_BASIC_STATS;
		stx->stx_nlink = 1;
		stx_from_stat(stx, &st);
		rc = 0;
	}
	return rc;
}

/* The entries binaries built against glibc before 2.33 call. */
int __xstat(int ver, const char *path, struct stat *st)
{
	PATH_STAT(get___xstat()(ver, path, st))
}

int __xstat64(int ver, const char *path, struct stat64 *st)
{
	PATH_STAT(get___xstat64()(ver, path, st))
}

int __lxstat(int ver, const char *path, struct stat *st)
{
	PATH_STAT(get___lxstat()(ver, path, st))
}

int __lxstat64(int ver, const char *path, struct stat64 *st)
{
	PATH_STAT(get___lxstat64()(ver, path, st))
}

int __fxstat(int ver, int fd, struct stat *st)
{
	return fd_stat(fd, get___fxstat()(ver, fd, st), st);
}

int __fxstat64(int ver, int fd, struct stat64 *st)
{
	return fd_stat(fd, get___fxstat64()(ver, fd, st), (struct stat *)st);
}
