/*
 * kcm: two small Linux kernel-CM (librdmacm) programs for pvcm's interop tests
 * (qemu-scripts/interop.sh, umad.sh), run inside a kernel-CM guest of the RDMA image
 * (build-guest.sh --rdma). rdma-core's tools cannot do either.
 *
 *   kcm withdraw -s SERVER_IPV4 [-p PORT] [-c COUNT] [-d DELAY_US]
 *     Connects and destroys the cm_id at once, COUNT times. The kernel CM withdraws
 *     each request with REJ(TIMEOUT) (cm_destroy_id in REQ_SENT): seed 002 seen from
 *     the kernel side. Exit 0 when every request was sent and withdrawn.
 *
 *   kcm listen [-p PORT]
 *     A listener that never exits: it accepts every request and destroys each child
 *     cm_id when its connection ends (rejected, disconnected, error), printing every
 *     event. After a peer's REJ(TIMEOUT), `rdma res show cm_id` lists only it.
 *
 * No QP is created: rdma_connect and rdma_accept take the QP number from conn_param,
 * which is all the CM messages need; the connections are never used.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>

static int wait_event(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;
	int got;

	if (rdma_get_cm_event(ch, &ev)) {
		perror("rdma_get_cm_event");
		return -1;
	}
	got = ev->event;
	rdma_ack_cm_event(ev);
	if (got != (int)want) {
		fprintf(stderr, "unexpected event %s (wanted %s)\n",
			rdma_event_str(got), rdma_event_str(want));
		return -1;
	}
	return 0;
}

/* The connection parameters of both programs: a made-up QP number (no QP exists),
 * rdma-core's usual one outstanding READ each way and unlimited RNR retries. */
static void conn_param(struct rdma_conn_param *p, unsigned qpn)
{
	memset(p, 0, sizeof(*p));
	p->qp_num = qpn;
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = 7;
	p->rnr_retry_count = 7;
}

static int listen_forever(int port)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *lid;
	struct sockaddr_in a;
	unsigned qpn = 0x5000;

	if (!ch || rdma_create_id(ch, &lid, NULL, RDMA_PS_TCP)) {
		perror("rdma_create_id");
		return 1;
	}
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	if (rdma_bind_addr(lid, (struct sockaddr *)&a) || rdma_listen(lid, 1024)) {
		perror("rdma_bind_addr/rdma_listen");
		return 1;
	}
	printf("listening on port %d\n", port);
	fflush(stdout);
	for (;;) {
		struct rdma_cm_event *ev;
		struct rdma_cm_id *id;
		int type, status;

		if (rdma_get_cm_event(ch, &ev)) {
			perror("rdma_get_cm_event");
			return 1;
		}
		id = ev->id;
		type = ev->event;
		status = ev->status;
		rdma_ack_cm_event(ev);
		printf("event %s status %d\n", rdma_event_str(type), status);
		fflush(stdout);
		switch (type) {
		case RDMA_CM_EVENT_CONNECT_REQUEST: {
			struct rdma_conn_param p;

			conn_param(&p, qpn++);
			if (rdma_accept(id, &p)) {
				perror("rdma_accept");
				rdma_destroy_id(id);
			}
			break;
		}
		case RDMA_CM_EVENT_ESTABLISHED:
			break;
		case RDMA_CM_EVENT_DISCONNECTED:
			rdma_disconnect(id);
			rdma_destroy_id(id);
			break;
		case RDMA_CM_EVENT_REJECTED:
		case RDMA_CM_EVENT_CONNECT_ERROR:
		case RDMA_CM_EVENT_UNREACHABLE:
			if (id != lid)
				rdma_destroy_id(id);
			break;
		default:
			break;
		}
	}
}

int main(int argc, char **argv)
{
	const char *server = NULL;
	int port = 7471, count = 1, delay_us = 0, opt, i, done = 0;
	struct sockaddr_in dst;
	struct rdma_event_channel *ch;

	if (argc < 2 || (strcmp(argv[1], "withdraw") && strcmp(argv[1], "listen"))) {
		fprintf(stderr, "usage: %s withdraw -s SERVER [-p PORT] [-c COUNT] [-d DELAY_US]\n"
			"       %s listen [-p PORT]\n", argv[0], argv[0]);
		return 2;
	}
	argv++;
	argc--;
	if (!strcmp(argv[0], "listen")) {
		while ((opt = getopt(argc, argv, "p:")) != -1)
			if (opt == 'p')
				port = atoi(optarg);
		return listen_forever(port);
	}
	while ((opt = getopt(argc, argv, "s:p:c:d:")) != -1) {
		switch (opt) {
		case 's': server = optarg; break;
		case 'p': port = atoi(optarg); break;
		case 'c': count = atoi(optarg); break;
		case 'd': delay_us = atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s -s SERVER [-p PORT] [-c COUNT] [-d DELAY_US]\n", argv[0]);
			return 2;
		}
	}
	if (!server || count < 1 || port < 1 || port > 65535) {
		fprintf(stderr, "usage: %s -s SERVER [-p PORT] [-c COUNT] [-d DELAY_US]\n", argv[0]);
		return 2;
	}
	memset(&dst, 0, sizeof(dst));
	dst.sin_family = AF_INET;
	dst.sin_port = htons(port);
	if (inet_pton(AF_INET, server, &dst.sin_addr) != 1) {
		fprintf(stderr, "%s: not an IPv4 address\n", server);
		return 2;
	}
	ch = rdma_create_event_channel();
	if (!ch) {
		perror("rdma_create_event_channel");
		return 1;
	}
	for (i = 0; i < count; i++) {
		struct rdma_cm_id *id;
		struct rdma_conn_param p;

		if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
			perror("rdma_create_id");
			break;
		}
		if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) ||
		    wait_event(ch, RDMA_CM_EVENT_ADDR_RESOLVED) ||
		    rdma_resolve_route(id, 2000) ||
		    wait_event(ch, RDMA_CM_EVENT_ROUTE_RESOLVED)) {
			fprintf(stderr, "resolve failed: %s\n", strerror(errno));
			rdma_destroy_id(id);
			break;
		}
		conn_param(&p, 0x4000 + i);
		if (rdma_connect(id, &p)) {
			perror("rdma_connect");
			rdma_destroy_id(id);
			break;
		}
		if (delay_us)
			usleep(delay_us);
		/* REQ_SENT: the kernel CM cancels the REQ and sends REJ(TIMEOUT). */
		if (rdma_destroy_id(id)) {
			perror("rdma_destroy_id");
			break;
		}
		printf("withdrawn %d qpn %#x\n", i, 0x4000 + i);
		done++;
	}
	rdma_destroy_event_channel(ch);
	printf("kcm withdraw: %d of %d requests sent and withdrawn\n", done, count);
	return done == count ? 0 : 1;
}
