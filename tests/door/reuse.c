/*
 * A program behind the door that ends its descriptors every way a program can
 * (close_range, dup2 over one, fclose, F_DUPFD, threads) and then uses the
 * numbers again for an ordinary file: the block-device ioctls on them must be
 * the ordinary file's (ENOTTY), and the file must keep its data. A device's
 * duplicate must still be the device.
 *
 * usage: reuse DEVICE FILE CONTROL
 * Prints "ok NAME" for each check that held, "FAIL NAME: why" otherwise, and
 * exits 1 after the first failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/dm-ioctl.h>
#include <linux/fs.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *dev, *file, *control;

static void fail(const char *what, const char *why)
{
	printf("FAIL %s: %s (errno %d %s)\n", what, why, errno, strerror(errno));
	fflush(stdout);
	exit(1);
}

static void ok(const char *what)
{
	printf("ok %s\n", what);
	fflush(stdout);
}

/* `fd` must be the ordinary file: not a block device, no block ioctls, and a
 * BLKDISCARD must not take its blocks. */
static void is_plain_file(int fd, const char *what)
{
	struct stat st, after;
	if (fstat(fd, &st) != 0)
		fail(what, "fstat");
	if (!S_ISREG(st.st_mode))
		fail(what, "fstat says it is not a regular file");
	uint64_t size = 0;
	if (ioctl(fd, BLKGETSIZE64, &size) == 0 || errno != ENOTTY)
		fail(what, "BLKGETSIZE64 was answered");
	uint64_t range[2] = {0, 1 << 20};
	if (ioctl(fd, BLKDISCARD, range) == 0 || errno != ENOTTY)
		fail(what, "BLKDISCARD was answered");
	if (fstat(fd, &after) != 0 || after.st_blocks != st.st_blocks || after.st_blocks == 0)
		fail(what, "the file lost blocks");
	int n = 0;
	if (ioctl(fd, FIONREAD, &n) != 0)
		fail(what, "FIONREAD failed");
	char b;
	if (pread(fd, &b, 1, 0) != 1 || b != 'x')
		fail(what, "the file's data changed");
}

static int open_dev(void)
{
	int fd = open(dev, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		fail("open device", dev);
	return fd;
}

static int open_file(void)
{
	int fd = open(file, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		fail("open file", file);
	return fd;
}

/* The ordinary file opened again must get number `n`, just ended as `what`
 * had it, and be the ordinary file there. */
static void file_on_number(int n, const char *what)
{
	int f = open_file();
	if (f != n)
		fail(what, "the file did not get the number just ended");
	is_plain_file(f, what);
	close(f);
	ok(what);
}

static void is_device(int fd, const char *what)
{
	struct stat st;
	uint64_t size = 0;
	if (fstat(fd, &st) != 0 || !S_ISBLK(st.st_mode))
		fail(what, "fstat does not say block device");
	if (ioctl(fd, BLKGETSIZE64, &size) != 0 || size == 0)
		fail(what, "BLKGETSIZE64 failed");
}

static void *thread_run(void *arg)
{
	(void)arg;
	for (int i = 0; i < 200; i++) {
		int d = open_dev();
		is_device(d, "thread device");
		close_range((unsigned)d, (unsigned)d, 0);
		int f = open_file();
		is_plain_file(f, "thread reused number");
		close(f);
		/* a door request on this thread's own connection */
		int c = open(control, O_RDWR);
		if (c < 0)
			fail("thread control", "open");
		struct dm_ioctl io;
		memset(&io, 0, sizeof(io));
		io.version[0] = DM_VERSION_MAJOR;
		io.data_size = sizeof(io);
		if (ioctl(c, DM_VERSION, &io) != 0)
			fail("thread control", "DM_VERSION");
		close(c);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: reuse DEVICE FILE CONTROL\n");
		return 2;
	}
	dev = argv[1];
	file = argv[2];
	control = argv[3];

	int d = open_dev();
	is_device(d, "device");
	ok("device");

	/* close_range, then the number again for the file */
	close_range((unsigned)d, (unsigned)d, 0);
	file_on_number(d, "close_range");

	/* dup2 of the file over a device's number */
	d = open_dev();
	int f = open_file();
	if (dup2(f, d) != d)
		fail("dup2", "dup2");
	is_plain_file(d, "dup2");
	close(d);
	close(f);
	ok("dup2");

	/* fclose */
	FILE *s = fopen(dev, "r+");
	if (!s)
		fail("fclose", "fopen");
	int n = fileno(s);
	fclose(s);
	file_on_number(n, "fclose");

	/* a device's duplicates are the device */
	d = open_dev();
	int d2 = dup(d), d3 = fcntl(d, F_DUPFD_CLOEXEC, 100);
	is_device(d2, "dup");
	is_device(d3, "F_DUPFD_CLOEXEC");
	close(d);
	is_device(d2, "dup after the original's close");
	close(d2);
	close(d3);
	ok("duplicates");

	/* the control node's number reused: a dm ioctl on the file is the file's */
	int c = open(control, O_RDWR);
	if (c < 0)
		fail("control", "open");
	close_range((unsigned)c, (unsigned)c, 0);
	f = open_file();
	if (f != c)
		fail("control", "the file did not get the control node's number");
	struct dm_ioctl io;
	memset(&io, 0, sizeof(io));
	io.version[0] = DM_VERSION_MAJOR;
	io.data_size = sizeof(io);
	if (ioctl(f, DM_VERSION, &io) == 0 || errno != ENOTTY)
		fail("control", "a dm ioctl on the file was answered");
	close(f);
	ok("control");

	/* the same under 16 threads */
	pthread_t t[16];
	for (int i = 0; i < 16; i++)
		if (pthread_create(&t[i], NULL, thread_run, NULL))
			fail("threads", "pthread_create");
	for (int i = 0; i < 16; i++)
		pthread_join(t[i], NULL);
	ok("threads");
	return 0;
}
