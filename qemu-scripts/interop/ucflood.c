/*
 * ucflood: a misbehaving rdma_cm process. THREADS threads, each on its own file of
 * /dev/infiniband/rdma_cm, issue commands as fast as they can for SECS seconds:
 *
 *   - garbage: unknown command numbers with random bodies, and known ones (never
 *     GET_EVENT, which may block as it should) with bodies too short to parse (each
 *     an error);
 *   - CREATE_ID with a response address outside the process (EFAULT; no id left);
 *   - DESTROY_ID and LISTEN on ids that are not the file's (ENOENT or EINVAL);
 *   - a valid CREATE_ID then DESTROY_ID (both succeed).
 *
 *   ucflood [-t THREADS] [-s SECS]
 *
 * Prints the calls made and each errno seen, then "ucflood: ok" when every call
 * returned (none hung: a watchdog aborts after SECS + 30 s), every call that must fail
 * failed, the bad address gave EFAULT and every good pair succeeded; exit 1 otherwise.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CMD_CREATE_ID 0
#define CMD_DESTROY_ID 1
#define CMD_LISTEN 7
#define CMD_GET_EVENT 12
#define PS_TCP 0x0106

struct counts {
	long calls, ok, einval, enoent, efault, enosys, enospc, other;
	long bad_ok;   /* a call that must fail and did not */
	long good_err; /* a good call that failed */
};

static int secs = 10;

static double now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void tally(struct counts *c, long r, int expect_ok)
{
	c->calls++;
	if (r >= 0) {
		c->ok++;
		if (!expect_ok)
			c->bad_ok++;
		return;
	}
	if (expect_ok)
		c->good_err++;
	switch (errno) {
	case EINVAL: c->einval++; break;
	case ENOENT: c->enoent++; break;
	case EFAULT: c->efault++; break;
	case ENOSYS: c->enosys++; break;
	case ENOSPC: c->enospc++; break;
	default: c->other++; break;
	}
}

/* struct rdma_ucm_cmd_hdr followed by the command. */
static long cmd(int fd, uint32_t op, const void *body, uint16_t in, uint16_t out)
{
	uint8_t buf[512];

	memcpy(buf, &op, 4);
	memcpy(buf + 4, &in, 2);
	memcpy(buf + 6, &out, 2);
	memcpy(buf + 8, body, in);
	return write(fd, buf, 8 + (size_t)in);
}

static void *flood(void *arg)
{
	struct counts *c = arg;
	unsigned int seed = (unsigned int)(uintptr_t)arg;
	double end = now_s() + secs;
	int fd = open("/dev/infiniband/rdma_cm", O_RDWR | O_CLOEXEC);

	if (fd < 0) {
		perror("open /dev/infiniband/rdma_cm");
		c->other++;
		return NULL;
	}
	while (now_s() < end) {
		uint8_t body[256];
		uint32_t id, op, resp_id = 0;
		uint64_t resp;
		size_t i;

		/* Garbage. */
		for (i = 0; i < sizeof(body); i++)
			body[i] = (uint8_t)rand_r(&seed);
		tally(c, cmd(fd, 40 + rand_r(&seed) % 1000, body, rand_r(&seed) % 200, 0), 0);
		op = rand_r(&seed) % 23;
		if (op != CMD_GET_EVENT)
			tally(c, cmd(fd, op, body, rand_r(&seed) % 4, 0), 0);

		/* CREATE_ID answering into an address the process does not map. */
		memset(body, 0, 24);
		resp = 0x10;
		memcpy(body + 8, &resp, 8);
		memcpy(body + 16, &(uint16_t){ PS_TCP }, 2);
		tally(c, cmd(fd, CMD_CREATE_ID, body, 24, 4), 0);

		/* Ids that are not this file's. */
		id = rand_r(&seed) % 4096;
		memset(body, 0, 16);
		memcpy(body + 8, &id, 4);
		resp = (uint64_t)(uintptr_t)&resp_id;
		memcpy(body, &resp, 8);
		tally(c, cmd(fd, CMD_DESTROY_ID, body, 16, 4), 0);
		memcpy(body, &id, 4);
		tally(c, cmd(fd, CMD_LISTEN, body, 8, 0), 0);

		/* A good CREATE_ID and its DESTROY_ID. */
		memset(body, 0, 24);
		resp = (uint64_t)(uintptr_t)&resp_id;
		memcpy(body + 8, &resp, 8);
		memcpy(body + 16, &(uint16_t){ PS_TCP }, 2);
		tally(c, cmd(fd, CMD_CREATE_ID, body, 24, 4), 1);
		memset(body, 0, 16);
		uint32_t events = 0;
		resp = (uint64_t)(uintptr_t)&events;
		memcpy(body, &resp, 8);
		memcpy(body + 8, &resp_id, 4);
		tally(c, cmd(fd, CMD_DESTROY_ID, body, 16, 4), 1);
	}
	close(fd);
	return NULL;
}

static void watchdog(int sig)
{
	(void)sig;
	static const char msg[] = "ucflood: a call hung\n";
	if (write(2, msg, sizeof(msg) - 1) < 0)
		_exit(2);
	_exit(2);
}

int main(int argc, char **argv)
{
	int threads = 4, opt, i;
	struct counts *c, total = { 0 };
	pthread_t *t;

	while ((opt = getopt(argc, argv, "t:s:")) != -1) {
		if (opt == 't')
			threads = atoi(optarg);
		else if (opt == 's')
			secs = atoi(optarg);
		else {
			fprintf(stderr, "usage: ucflood [-t THREADS] [-s SECS]\n");
			return 2;
		}
	}
	if (threads <= 0 || threads > 256 || secs <= 0) {
		fprintf(stderr, "ucflood: -t 1..256, -s positive\n");
		return 2;
	}
	signal(SIGALRM, watchdog);
	alarm((unsigned int)secs + 30);
	c = calloc((size_t)threads, sizeof(*c));
	t = calloc((size_t)threads, sizeof(*t));
	if (!c || !t)
		return 1;
	for (i = 0; i < threads; i++)
		pthread_create(&t[i], NULL, flood, &c[i]);
	for (i = 0; i < threads; i++) {
		pthread_join(t[i], NULL);
		total.calls += c[i].calls;
		total.ok += c[i].ok;
		total.einval += c[i].einval;
		total.enoent += c[i].enoent;
		total.efault += c[i].efault;
		total.enosys += c[i].enosys;
		total.enospc += c[i].enospc;
		total.other += c[i].other;
		total.bad_ok += c[i].bad_ok;
		total.good_err += c[i].good_err;
	}
	printf("ucflood: %ld calls: ok %ld, EINVAL %ld, ENOENT %ld, EFAULT %ld, ENOSYS %ld, "
	       "ENOSPC %ld, other %ld; must-fail calls that succeeded %ld, good calls that "
	       "failed %ld\n",
	       total.calls, total.ok, total.einval, total.enoent, total.efault, total.enosys,
	       total.enospc, total.other, total.bad_ok, total.good_err);
	if (total.calls == 0 || total.bad_ok || total.good_err || total.efault == 0 ||
	    total.ok == 0) {
		printf("ucflood: FAILED\n");
		return 1;
	}
	printf("ucflood: ok\n");
	return 0;
}
