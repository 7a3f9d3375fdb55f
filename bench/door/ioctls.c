/*
 * The door's cost per ioctl, for bench/door_guest.sh:
 *   ioctls status N   N DM_TABLE_STATUS ioctls on /dev/mapper/control with
 *                     libdevmapper's 16 KiB buffer, on the devices n1..n300
 *                     in turn; prints the microseconds per ioctl
 *   ioctls pingpong N N round trips of a 312-byte message between two
 *                     processes over a socketpair (the least a daemon's
 *                     answer can cost); prints the microseconds per trip
 */
#include <fcntl.h>
#include <linux/dm-ioctl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int status(int n)
{
	int fd = open("/dev/mapper/control", O_RDWR);
	if (fd < 0) {
		perror("/dev/mapper/control");
		return 1;
	}
	static char b[16384];
	double t = now_us();
	for (int i = 0; i < n; i++) {
		struct dm_ioctl *d = (struct dm_ioctl *)b;
		memset(b, 0, sizeof(b));
		d->version[0] = 4;
		d->data_size = sizeof(b);
		d->data_start = sizeof(*d);
		snprintf(d->name, sizeof(d->name), "n%d", i % 300 + 1);
		if (ioctl(fd, DM_TABLE_STATUS, b) < 0) {
			perror("DM_TABLE_STATUS");
			return 1;
		}
	}
	printf("%.0f\n", (now_us() - t) / n);
	return 0;
}

static int full(int fd, char *p, size_t n)
{
	while (n) {
		ssize_t k = read(fd, p, n);
		if (k <= 0)
			return -1;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

static int pingpong(int n)
{
	int sv[2];
	char m[312] = {0};
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) {
		perror("socketpair");
		return 1;
	}
	pid_t c = fork();
	if (c == 0) {
		close(sv[0]);
		while (!full(sv[1], m, sizeof(m)))
			if (write(sv[1], m, sizeof(m)) != (ssize_t)sizeof(m))
				_exit(1);
		_exit(0);
	}
	close(sv[1]);
	double t = now_us();
	for (int i = 0; i < n; i++)
		if (write(sv[0], m, sizeof(m)) != (ssize_t)sizeof(m) || full(sv[0], m, sizeof(m))) {
			perror("pingpong");
			return 1;
		}
	printf("%.0f\n", (now_us() - t) / n);
	close(sv[0]);
	waitpid(c, NULL, 0);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: ioctls status|pingpong N\n");
		return 2;
	}
	int n = atoi(argv[2]);
	if (n <= 0)
		return 2;
	return strcmp(argv[1], "status") == 0 ? status(n) : pingpong(n);
}
