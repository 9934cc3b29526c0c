/*
 * sigwait: signals to a program blocked in rdma_get_cm_event(), for the apps suite's
 * signal section (qemu-scripts/netlab/apps.py), run the same in a kernel-CM guest and
 * a pvcm VM.
 *
 *   sigwait listen [-p PORT] [-i MS] [-n]
 *     Listens on PORT (any address) and blocks in rdma_get_cm_event() while SIGALRM
 *     fires every MS ms (default 200) into a handler installed with SA_RESTART (-n:
 *     without it). On the first CONNECT_REQUEST it rejects it and exits 0, printing
 *     "connect request after N alarms"; if rdma_get_cm_event() fails it prints
 *     "rdma_get_cm_event: ERRNO after N alarms" and exits 3 for EINTR, 1 otherwise.
 *
 *   sigwait connect -s SERVER_IPV4 [-p PORT]
 *     Connects once (no QP: the QP number comes from conn_param) and prints the event
 *     that ends the attempt ("event REJECTED status 8"); exit 0 when one came.
 *
 *   sigwait ptrace PID
 *     What a debugger's attach does (PTRACE_ATTACH: a SIGSTOP and a ptrace stop), then
 *     detaches; exit 0 when the process was stopped and let go.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <rdma/rdma_cma.h>

static volatile sig_atomic_t alarms;

static void on_alarm(int sig)
{
	(void)sig;
	alarms++;
}

static void conn_param(struct rdma_conn_param *p, unsigned qpn)
{
	memset(p, 0, sizeof(*p));
	p->qp_num = qpn;
	p->responder_resources = 1;
	p->initiator_depth = 1;
	p->retry_count = 7;
	p->rnr_retry_count = 7;
}

static int listen_once(int port, int interval_ms, int restart)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *lid;
	struct sockaddr_in a;
	struct sigaction sa;
	struct itimerval it;

	if (!ch || rdma_create_id(ch, &lid, NULL, RDMA_PS_TCP)) {
		perror("rdma_create_id");
		return 1;
	}
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	if (rdma_bind_addr(lid, (struct sockaddr *)&a) || rdma_listen(lid, 8)) {
		perror("rdma_bind_addr/rdma_listen");
		return 1;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_alarm;
	sigemptyset(&sa.sa_mask);
	sa.sa_flags = restart ? SA_RESTART : 0;
	if (sigaction(SIGALRM, &sa, NULL)) {
		perror("sigaction");
		return 1;
	}
	memset(&it, 0, sizeof(it));
	it.it_interval.tv_sec = interval_ms / 1000;
	it.it_interval.tv_usec = (interval_ms % 1000) * 1000;
	it.it_value = it.it_interval;
	if (setitimer(ITIMER_REAL, &it, NULL)) {
		perror("setitimer");
		return 1;
	}
	printf("listening on port %d, SIGALRM every %d ms, %s\n", port, interval_ms,
	       restart ? "SA_RESTART" : "no SA_RESTART");
	fflush(stdout);
	for (;;) {
		struct rdma_cm_event *ev;
		struct rdma_cm_id *id;
		int type, err;

		if (rdma_get_cm_event(ch, &ev)) {
			err = errno;
			memset(&it, 0, sizeof(it));
			setitimer(ITIMER_REAL, &it, NULL);
			printf("rdma_get_cm_event: %s after %d alarms\n",
			       err == EINTR ? "EINTR" : strerror(err), (int)alarms);
			return err == EINTR ? 3 : 1;
		}
		id = ev->id;
		type = ev->event;
		rdma_ack_cm_event(ev);
		if (type != RDMA_CM_EVENT_CONNECT_REQUEST) {
			printf("event %s\n", rdma_event_str(type));
			continue;
		}
		memset(&it, 0, sizeof(it));
		setitimer(ITIMER_REAL, &it, NULL);
		rdma_reject(id, NULL, 0);
		rdma_destroy_id(id);
		printf("connect request after %d alarms\n", (int)alarms);
		rdma_destroy_id(lid);
		rdma_destroy_event_channel(ch);
		return 0;
	}
}

static int connect_once(const char *server, int port)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_conn_param p;
	struct rdma_cm_event *ev;
	struct rdma_cm_id *id;
	struct sockaddr_in dst;
	int type, status;

	memset(&dst, 0, sizeof(dst));
	dst.sin_family = AF_INET;
	dst.sin_port = htons(port);
	if (inet_pton(AF_INET, server, &dst.sin_addr) != 1) {
		fprintf(stderr, "%s: not an IPv4 address\n", server);
		return 2;
	}
	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
		perror("rdma_create_id");
		return 1;
	}
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000) ||
	    rdma_get_cm_event(ch, &ev)) {
		perror("rdma_resolve_addr");
		return 1;
	}
	rdma_ack_cm_event(ev);
	if (rdma_resolve_route(id, 2000) || rdma_get_cm_event(ch, &ev)) {
		perror("rdma_resolve_route");
		return 1;
	}
	rdma_ack_cm_event(ev);
	conn_param(&p, 0x4100);
	if (rdma_connect(id, &p) || rdma_get_cm_event(ch, &ev)) {
		perror("rdma_connect");
		return 1;
	}
	type = ev->event;
	status = ev->status;
	rdma_ack_cm_event(ev);
	printf("event %s status %d\n", rdma_event_str(type), status);
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	return 0;
}

static int ptrace_attach(pid_t pid)
{
	int st;

	if (ptrace(PTRACE_ATTACH, pid, NULL, NULL)) {
		perror("PTRACE_ATTACH");
		return 1;
	}
	if (waitpid(pid, &st, __WALL) != pid || !WIFSTOPPED(st)) {
		fprintf(stderr, "no ptrace stop (status %#x)\n", st);
		return 1;
	}
	printf("attached: stopped by signal %d\n", WSTOPSIG(st));
	/* Detach without handing the SIGSTOP back: the tracee goes on. */
	if (ptrace(PTRACE_DETACH, pid, NULL, NULL)) {
		perror("PTRACE_DETACH");
		return 1;
	}
	printf("detached\n");
	return 0;
}

int main(int argc, char **argv)
{
	int port = 7476, interval = 200, restart = 1, opt;
	const char *server = NULL;

	if (argc < 2) {
		fprintf(stderr, "usage: %s listen [-p PORT] [-i MS] [-n] | connect -s SERVER "
			"[-p PORT] | ptrace PID\n", argv[0]);
		return 2;
	}
	if (!strcmp(argv[1], "ptrace"))
		return argc == 3 ? ptrace_attach(atoi(argv[2])) : 2;
	while ((opt = getopt(argc - 1, argv + 1, "p:i:ns:")) != -1) {
		switch (opt) {
		case 'p': port = atoi(optarg); break;
		case 'i': interval = atoi(optarg); break;
		case 'n': restart = 0; break;
		case 's': server = optarg; break;
		default: return 2;
		}
	}
	if (port < 1 || port > 65535 || interval < 1)
		return 2;
	if (!strcmp(argv[1], "listen"))
		return listen_once(port, interval, restart);
	if (!strcmp(argv[1], "connect") && server)
		return connect_once(server, port);
	fprintf(stderr, "unknown command %s\n", argv[1]);
	return 2;
}
