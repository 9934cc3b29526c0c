/*
 * usrevent: what librdmacm 60 and later asks of the rdma_cm device beyond the older
 * commands, for the apps suite (qemu-scripts/netlab/apps.py, section 13). Built on the
 * host against its librdmacm (which may predate these calls: they are looked up at run
 * time), run in a guest with a newer one.
 *
 *   usrevent write   rdma_write_cm_event(id, RDMA_CM_EVENT_USER, -7, ARG) while another
 *                    thread waits in rdma_get_cm_event on the id's channel: that thread
 *                    gets the event, its status and its argument. Then
 *                    rdma_resolve_addrinfo(id, "127.0.0.1", "7471", NULL), which
 *                    librdmacm answers with an INTERNAL event it writes itself: the
 *                    next event is ADDRINFO_RESOLVED and rdma_query_addrinfo gives
 *                    the address.
 *   usrevent ibservice ADDR
 *                    RESOLVE_IB_SERVICE written to /dev/infiniband/rdma_cm for an id
 *                    bound to ADDR (the device's own address): prints the errno.
 *
 * Prints one line per step ("write_cm_event: ...", "resolve_addrinfo: ...",
 * "resolve_ib_service: errno N (NAME)"); "usrevent: absent" and exit 2 when the
 * librdmacm has no rdma_write_cm_event; exit 0 when every step went as librdmacm
 * expects, 1 otherwise (ibservice: 0 whenever the command was answered).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>

#define EVENT_ADDRINFO_RESOLVED 16
#define EVENT_USER 18
#define USER_ARG 0x5a5a0000c0deULL
#define USER_STATUS (-7)

typedef int (*write_cm_event_fn)(struct rdma_cm_id *, int, int, uint64_t);
typedef int (*resolve_addrinfo_fn)(struct rdma_cm_id *, const char *, const char *,
				   const struct rdma_addrinfo *);
typedef int (*query_addrinfo_fn)(struct rdma_cm_id *, struct rdma_addrinfo **);

struct waiter {
	struct rdma_event_channel *ch;
	int event, status, ret;
	uint64_t arg;
};

static void *wait_event(void *p)
{
	struct waiter *w = p;
	struct rdma_cm_event *ev;

	w->ret = rdma_get_cm_event(w->ch, &ev);
	if (w->ret)
		return NULL;
	w->event = ev->event;
	w->status = ev->status;
	/* param.arg, the union's first 8 bytes (older headers lack the member). */
	memcpy(&w->arg, &ev->param, sizeof(w->arg));
	rdma_ack_cm_event(ev);
	return NULL;
}

static int do_write(void)
{
	write_cm_event_fn write_ev = (write_cm_event_fn)dlsym(RTLD_DEFAULT, "rdma_write_cm_event");
	resolve_addrinfo_fn resolve = (resolve_addrinfo_fn)dlsym(RTLD_DEFAULT, "rdma_resolve_addrinfo");
	query_addrinfo_fn query = (query_addrinfo_fn)dlsym(RTLD_DEFAULT, "rdma_query_addrinfo");
	struct rdma_event_channel *ch;
	struct rdma_addrinfo *ai = NULL;
	struct rdma_cm_id *id;
	struct waiter w = { 0 };
	pthread_t t;
	char host[64] = "?";
	int ok = 1;

	if (!write_ev || !resolve || !query) {
		printf("usrevent: absent (this librdmacm has no rdma_write_cm_event)\n");
		return 2;
	}
	ch = rdma_create_event_channel();
	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
		perror("rdma_create_event_channel/rdma_create_id");
		return 1;
	}
	w.ch = ch;
	pthread_create(&t, NULL, wait_event, &w);
	usleep(300000); /* the thread is in rdma_get_cm_event */
	if (write_ev(id, EVENT_USER, USER_STATUS, USER_ARG)) {
		printf("write_cm_event: error %d (%s)\n", errno, strerror(errno));
		pthread_cancel(t);
		return 1;
	}
	pthread_join(t, NULL);
	if (w.ret || w.event != EVENT_USER || w.status != USER_STATUS || w.arg != USER_ARG)
		ok = 0;
	printf("write_cm_event: %s: the waiting thread got event %d status %d arg %#llx\n",
	       ok ? "ok" : "wrong", w.event, w.status, (unsigned long long)w.arg);

	if (resolve(id, "127.0.0.1", "7471", NULL)) {
		printf("resolve_addrinfo: error %d (%s)\n", errno, strerror(errno));
		return 1;
	}
	wait_event(&w);
	if (!w.ret && w.event == EVENT_ADDRINFO_RESOLVED && !query(id, &ai) && ai &&
	    ai->ai_dst_addr && ai->ai_dst_addr->sa_family == AF_INET) {
		inet_ntop(AF_INET, &((struct sockaddr_in *)ai->ai_dst_addr)->sin_addr, host,
			  sizeof(host));
		printf("resolve_addrinfo: ok: ADDRINFO_RESOLVED, %s port %u\n", host,
		       ntohs(((struct sockaddr_in *)ai->ai_dst_addr)->sin_port));
	} else {
		printf("resolve_addrinfo: wrong: ret %d event %d\n", w.ret, w.event);
		ok = 0;
	}
	if (ai)
		rdma_freeaddrinfo(ai);
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	return ok ? 0 : 1;
}

/* The raw commands: the header, then the body (struct rdma_ucm_*). */
static int ucm(int fd, uint32_t cmd, void *body, uint16_t in, uint16_t out)
{
	uint8_t b[512];

	memcpy(b, &cmd, 4);
	memcpy(b + 4, &in, 2);
	memcpy(b + 6, &out, 2);
	memcpy(b + 8, body, in);
	return write(fd, b, 8 + in) == 8 + in ? 0 : -errno;
}

static int do_ibservice(const char *addr)
{
	uint8_t create[24] = { 0 }, bind[40] = { 0 }, ibs[88] = { 0 };
	struct sockaddr_in sin = { .sin_family = AF_INET };
	uint64_t resp = 0, uid = 1, service = 0x10000ce;
	uint32_t id = 0, flags = 1;
	uint16_t ps = RDMA_PS_TCP;
	int fd, r;

	fd = open("/dev/infiniband/rdma_cm", O_RDWR);
	if (fd < 0 || inet_pton(AF_INET, addr, &sin.sin_addr) != 1) {
		perror("open /dev/infiniband/rdma_cm or the address");
		return 1;
	}
	resp = (uint64_t)(uintptr_t)&id;
	memcpy(create, &uid, 8);
	memcpy(create + 8, &resp, 8);
	memcpy(create + 16, &ps, 2);
	r = ucm(fd, 0, create, sizeof(create), 4); /* CREATE_ID */
	memcpy(bind + 8, &sin, sizeof(sin));	   /* BIND_IP: response, addr, id */
	memcpy(bind + 36, &id, 4);
	if (!r)
		r = ucm(fd, 2, bind, sizeof(bind), 0);
	if (r) {
		printf("resolve_ib_service: setup failed: errno %d (%s)\n", -r, strerror(-r));
		return 1;
	}
	memcpy(ibs, &id, 4);
	memcpy(ibs + 8, &service, 8);
	memcpy(ibs + 80, &flags, 4);
	r = ucm(fd, 23, ibs, sizeof(ibs), 0); /* RESOLVE_IB_SERVICE */
	printf("resolve_ib_service: errno %d (%s)\n", -r, r ? strerror(-r) : "none");
	close(fd);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "write"))
		return do_write();
	if (argc == 3 && !strcmp(argv[1], "ibservice"))
		return do_ibservice(argv[2]);
	fprintf(stderr, "usage: %s write | ibservice ADDR\n", argv[0]);
	return 1;
}
