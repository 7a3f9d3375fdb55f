/*
 * What multipathd does with the control node, in miniature: DM_DEV_ARM_POLL,
 * then poll() on the same descriptor, which becomes readable (POLLIN) once an
 * event happens (here: the test renames a device after reading "armed").
 * Prints one line per step; tests/dmsetup_door.rs checks each.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/dm-ioctl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

static int control;

static int request(unsigned long req)
{
	char buf[16384];
	struct dm_ioctl *io = (struct dm_ioctl *)buf;
	memset(buf, 0, sizeof(buf));
	io->version[0] = DM_VERSION_MAJOR;
	io->data_size = sizeof(buf);
	io->data_start = sizeof(*io);
	return ioctl(control, req, io) == 0 ? 0 : errno;
}

static const char *wait_for(int ms)
{
	struct pollfd p = {.fd = control, .events = POLLIN};
	int n = poll(&p, 1, ms);
	if (n < 0)
		return "error";
	return n == 0 ? "quiet" : (p.revents & POLLIN) ? "POLLIN" : "other";
}

int main(void)
{
	control = open("/dev/mapper/control", O_RDWR);
	if (control < 0) {
		perror("open /dev/mapper/control");
		return 1;
	}
	printf("arm: %s\n", request(DM_DEV_ARM_POLL) == 0 ? "ok" : "failed");
	printf("before an event: %s\n", wait_for(300));
	printf("armed\n");
	fflush(stdout);
	printf("after the event: %s\n", wait_for(10000));
	printf("still: %s\n", wait_for(0));
	printf("version: %s\n", request(DM_VERSION) == 0 ? "ok" : "failed");
	printf("re-arm: %s\n", request(DM_DEV_ARM_POLL) == 0 ? "ok" : "failed");
	printf("after re-arming: %s\n", wait_for(300));
	return 0;
}
