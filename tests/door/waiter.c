/*
 * What dmeventd does with the control node, in miniature: one thread waits for
 * an event of device NAME (DM_DEV_WAIT), the main thread asks other things
 * meanwhile (DM_VERSION, DM_DEV_STATUS) and then interrupts the waiter with a
 * signal. Prints one line per step; tests/dmsetup_door.rs checks each.
 * Usage: waiter NAME
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/dm-ioctl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

static int control;
static const char *name;
static volatile int waited_errno = -1;

static void init(struct dm_ioctl *io, size_t size)
{
	memset(io, 0, size);
	io->version[0] = DM_VERSION_MAJOR;
	io->data_size = (unsigned)size;
	io->data_start = sizeof(*io);
	if (name)
		snprintf(io->name, sizeof(io->name), "%s", name);
}

static void on_alarm(int sig)
{
	(void)sig;
}

static void *waiter(void *arg)
{
	(void)arg;
	char buf[16384];
	struct dm_ioctl *io = (struct dm_ioctl *)buf;
	init(io, sizeof(buf));
	if (ioctl(control, DM_DEV_STATUS, io) != 0) {
		waited_errno = errno;
		return NULL;
	}
	unsigned ev = io->event_nr;
	init(io, sizeof(buf));
	io->event_nr = ev;
	int r = ioctl(control, DM_DEV_WAIT, io);
	waited_errno = r == 0 ? 0 : errno;
	return NULL;
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	if (argc != 2)
		return 2;
	name = argv[1];
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_alarm; /* no SA_RESTART: the ioctl returns EINTR */
	sigaction(SIGALRM, &sa, NULL);
	control = open("/dev/mapper/control", O_RDWR);
	if (control < 0) {
		perror("open /dev/mapper/control");
		return 1;
	}
	pthread_t t;
	pthread_create(&t, NULL, waiter, NULL);
	usleep(300000);
	printf("waiter still waiting: %s\n", waited_errno == -1 ? "yes" : "no");
	char buf[16384];
	struct dm_ioctl *io = (struct dm_ioctl *)buf;
	const char *keep = name;
	name = NULL;
	init(io, sizeof(buf));
	double t0 = now();
	int r = ioctl(control, DM_VERSION, io);
	double took = now() - t0;
	printf("version while it waits: %s in %s\n", r == 0 ? "ok" : strerror(errno), took < 1.0 ? "under 1 s" : "1 s or more");
	name = keep;
	init(io, sizeof(buf));
	r = ioctl(control, DM_DEV_STATUS, io);
	printf("status while it waits: %s\n", r == 0 ? "ok" : strerror(errno));
	pthread_kill(t, SIGALRM);
	pthread_join(t, NULL);
	printf("waiter after the signal: %s\n", waited_errno == EINTR ? "EINTR" : waited_errno == 0 ? "woke" : strerror(waited_errno));
	init(io, sizeof(buf));
	r = ioctl(control, DM_DEV_STATUS, io);
	printf("status after: %s\n", r == 0 ? "ok" : strerror(errno));
	return 0;
}
