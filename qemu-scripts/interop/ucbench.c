/*
 * ucbench: what one rdma_cm command costs a process, through whatever serves
 * /dev/infiniband/rdma_cm (the kernel's rdma_ucm, or pvcm-guestd through CUSE).
 *
 *   ucbench [-n COUNT]
 *
 * Two loops of COUNT iterations, each timed with CLOCK_MONOTONIC:
 *   create+destroy  rdma_create_id() then rdma_destroy_id() through librdmacm (two
 *                   commands, each answered by the CM service)
 *   bare command    a write() of a command number no ABI defines on the device,
 *                   answered at once with an error (EINVAL by the kernel's
 *                   ucma_write): the round trip to the server and nothing else
 *
 * Prints one line per loop: "NAME: X us per command (COUNT commands)".
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>

static double now_us(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv)
{
	struct rdma_event_channel *ch;
	struct rdma_cm_id *id;
	long n = 2000;
	double t0, t1;
	int fd, opt;
	long i;

	while ((opt = getopt(argc, argv, "n:")) != -1) {
		if (opt == 'n') {
			n = strtol(optarg, NULL, 0);
			if (n <= 0) {
				fprintf(stderr, "ucbench: -n needs a positive count\n");
				return 2;
			}
		} else {
			fprintf(stderr, "usage: ucbench [-n COUNT]\n");
			return 2;
		}
	}

	ch = rdma_create_event_channel();
	if (!ch) {
		perror("rdma_create_event_channel");
		return 1;
	}
	t0 = now_us();
	for (i = 0; i < n; i++) {
		if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
			perror("rdma_create_id");
			return 1;
		}
		if (rdma_destroy_id(id)) {
			perror("rdma_destroy_id");
			return 1;
		}
	}
	t1 = now_us();
	printf("create+destroy: %.1f us per command (%ld commands)\n", (t1 - t0) / (2.0 * n),
	       2 * n);
	rdma_destroy_event_channel(ch);

	fd = open("/dev/infiniband/rdma_cm", O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		perror("open /dev/infiniband/rdma_cm");
		return 1;
	}
	t0 = now_us();
	for (i = 0; i < n; i++) {
		/* struct rdma_ucm_cmd_hdr: cmd, in, out; no command has this number. */
		uint32_t hdr[2] = { 0xFFFF, 0 };

		if (write(fd, hdr, sizeof(hdr)) >= 0 || errno != EINVAL) {
			fprintf(stderr, "ucbench: an unknown command was not EINVAL: %s\n",
				strerror(errno));
			return 1;
		}
	}
	t1 = now_us();
	printf("bare command: %.1f us per command (%ld commands)\n", (t1 - t0) / n, n);
	close(fd);
	return 0;
}
