// Offline checks of deploy/k8s: every overlay renders with `kubectl
// kustomize`, every rendered object validates against its schema (core
// kinds: kubernetes-models; KEDA: @kubernetes-models/keda; LeaderWorkerSet:
// ajv against ../shared/k8s/leaderworkerset-v1.schema.json), and the
// properties an operator relies on hold (see CHECKS below).  Then each
// property check is run once more on objects broken on purpose and must
// report the break: a check that cannot fail checks nothing.
//
// Run by tests/deploy/test_k8s.c; by hand:  cd tests/deploy && npm ci &&
//   node validate.mjs [--kubectl PATH] [--bin BUILD_DIR]
// --bin: a build tree whose llm-router, llm-worker and llm-gateway --help
// list the LLM_* variables the manifests may set.
import { execFileSync } from 'node:child_process';
import { readFileSync, readdirSync, existsSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import YAML from 'yaml';
import Ajv from 'ajv';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '../..');
const shared = resolve(root, '../shared');
const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : dflt;
};
const kubectl = opt('--kubectl', process.env.KUBECTL || 'kubectl');
const binDir = opt('--bin', process.env.LLM_BINARY_DIR || '');

/* ---- what the code says (read from the sources, so the checks follow it) ---- */

// The worker's longest drain after SIGTERM.
const drainMs = (() => {
  const m = /#define\s+NODE_DRAIN_MAX_MS\s+(\d+)/.exec(readFileSync(join(root, 'worker/node-impl.h'), 'utf8'));
  if (!m) throw new Error('worker/node-impl.h: no NODE_DRAIN_MAX_MS');
  return Number(m[1]);
})();
// The routers' consumer group on the request stream.
const routerGroup = (() => {
  const m = /#define\s+REQSTORE_GROUP\s+"([^"]+)"/.exec(readFileSync(join(root, 'router/requests.c'), 'utf8'));
  if (!m) throw new Error('router/requests.c: no REQSTORE_GROUP');
  return m[1];
})();
const deployDoc = readFileSync(join(root, 'docs/deploy.md'), 'utf8');

// LLM_* names each program lists in --help (null: not built, not checked).
const helps = {};
for (const [prog, sub] of [['llm-router', 'router'], ['llm-worker', 'worker'], ['llm-gateway', 'gateway']]) {
  const path = binDir && join(binDir, sub, prog);
  if (path && existsSync(path)) helps[prog] = new Set(execFileSync(path, ['--help'], { encoding: 'utf8' }).match(/LLM_[A-Z0-9_]+/g));
}
// Names agreed for the trust and metrics interfaces (/tmp contract, docs/
// deploy.md "Secrets") that a program may not list yet while they are being
// built; each one a program lacks is reported as a note, not an error.
const contractNames = new Set(['LLM_CURVE_KEY_FILE', 'LLM_INSECURE', 'LLM_CLIENT_KEYS', 'LLM_WORKER_KEYS',
  'LLM_ROUTER_KEY', 'LLM_REDIS_PASSWORD_FILE', 'LLM_MAX_MSG_SIZE', 'LLM_METRICS_LISTEN']);
const notes = new Set();

/* ---- rendering ---- */

const overlaysDir = join(root, 'deploy/k8s/overlays');
const targets = readdirSync(overlaysDir).sort().map((d) => [join('deploy/k8s/overlays', d)]);
// The model-fill Job goes into a cluster an overlay made (its namespace,
// claim and default-deny policy): checked together with the CPU overlay.
targets.push(['deploy/k8s/overlays/cpu', 'deploy/k8s/model-fill']);
// The laptop's copy pod goes into the CPU overlay's cluster too; the
// PodMonitors beside the T4 overlay ask for monitoring (ctx.monitored).
targets.push(['deploy/k8s/overlays/cpu', 'deploy/k8s/model-copy']);
targets.push(['deploy/k8s/overlays/t4', 'deploy/k8s/monitoring']);
// Outside the cluster's namespace on purpose (root, CAP_CHOWN): schemas and
// its own check only (PREPARE_CHECKS).
const prepareTargets = [['deploy/k8s/storage/gke-prepare']];
// The provider overlays the docs walk through: each must exist and render.
const providerOverlays = ['t4-gke', 't4-eks', 't4-aks'];
// The uid every program of the cluster runs as (deploy/Dockerfile), which
// the model share must let write.
const clusterUid = 10001;
// The smallest T4 hosts (g4dn.xlarge 16 GiB, GKE n1-standard-4 15 GB) leave
// about 11 GiB allocatable to pods: a worker's request must fit beside the
// node's daemons, its limit below the host's memory net of the system's.
const t4WorkerRequestMax = 10 * 2 ** 30, t4WorkerLimitMax = 12 * 2 ** 30;

function render(dir) {
  const out = execFileSync(kubectl, ['kustomize', join(root, dir)], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  return YAML.parseAllDocuments(out).map((d) => d.toJS()).filter((o) => o);
}
// The images: list of a kustomization and of every base it builds on.
function imageEntries(dir) {
  const k = YAML.parse(readFileSync(join(root, dir, 'kustomization.yaml'), 'utf8'));
  let list = (k.images || []).map((e) => ({ ...e, from: dir }));
  for (const b of [...(k.bases || []), ...(k.resources || [])]) {
    const sub = join(dir, b);
    if (existsSync(join(root, sub, 'kustomization.yaml'))) list = list.concat(imageEntries(sub));
  }
  return list;
}

/* ---- schemas ---- */

const ajv = new Ajv({ strict: false, allErrors: true });
// The OpenAPI formats of Kubernetes schemas.
ajv.addFormat('int32', { type: 'number', validate: (x) => Number.isInteger(x) && x >= -(2 ** 31) && x < 2 ** 31 });
ajv.addFormat('int64', { type: 'number', validate: (x) => Number.isInteger(x) });
ajv.addFormat('double', { type: 'number', validate: () => true });
ajv.addFormat('date-time', /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$/);
const lwsValidate = ajv.compile(JSON.parse(readFileSync(join(shared, 'k8s/leaderworkerset-v1.schema.json'), 'utf8')));

async function validateSchema(o) {
  const [group, version] = o.apiVersion.includes('/') ? o.apiVersion.split('/') : ['', o.apiVersion];
  if (group === 'leaderworkerset.x-k8s.io') {
    if (o.kind !== 'LeaderWorkerSet' || version !== 'v1') return `unknown kind ${o.apiVersion} ${o.kind}`;
    if (lwsValidate(o)) return null;
    return ajv.errorsText(lwsValidate.errors, { dataVar: o.kind });
  }
  let mod;
  if (group === 'keda.sh') mod = `@kubernetes-models/keda/keda.sh/${version}/${o.kind}`;
  else if (group === 'monitoring.coreos.com') mod = `@kubernetes-models/prometheus-operator/monitoring.coreos.com/${version}/${o.kind}`;
  else mod = `kubernetes-models/${group ? group + '/' : ''}${version}/${o.kind}`;
  let Model;
  try {
    Model = (await import(mod))[o.kind];
  } catch {
    return `no schema for ${o.apiVersion} ${o.kind} (${mod})`;
  }
  try {
    new Model(o).validate();
    return null;
  } catch (e) {
    return String(e.message || e).slice(0, 2000);
  }
}

/* ---- helpers over rendered objects ---- */

const name = (o) => `${o.kind}/${o.metadata.name}`;
// Pod templates: [owner, pod template, long-running?]
function podTemplates(objs) {
  const r = [];
  for (const o of objs) {
    if (['Deployment', 'StatefulSet', 'DaemonSet'].includes(o.kind)) r.push([o, o.spec.template, true]);
    else if (o.kind === 'Job') r.push([o, o.spec.template, false]);
    else if (o.kind === 'LeaderWorkerSet') {
      r.push([o, o.spec.leaderWorkerTemplate.workerTemplate, true]);
      if (o.spec.leaderWorkerTemplate.leaderTemplate) r.push([o, o.spec.leaderWorkerTemplate.leaderTemplate, true]);
    } else if (o.kind === 'Pod') r.push([o, o, false]); // a helper (model-copy), not a service
  }
  return r;
}
const containersOf = (t) => [...(t.spec.initContainers || []), ...(t.spec.containers || [])];
const labelsOf = (t) => (t.metadata && t.metadata.labels) || {};
const selects = (sel, labels) =>
  sel && Object.entries(sel.matchLabels || {}).every(([k, v]) => labels[k] === v) && !(sel.matchExpressions || []).length;
const envValue = (c, n) => ((c.env || []).find((e) => e.name === n) || {}).value;
const configMap = (objs, n) => objs.find((o) => o.kind === 'ConfigMap' && o.metadata.name === n);
// The value a container sees for n: env (a value or a ConfigMap key), else a
// ConfigMap of envFrom.
function envSeen(objs, c, n) {
  const v = envValue(c, n);
  if (v !== undefined) return v;
  const ref = (c.env || []).find((e) => e.name === n)?.valueFrom?.configMapKeyRef;
  if (ref) return configMap(objs, ref.name)?.data?.[ref.key];
  for (const f of c.envFrom || []) {
    const cm = f.configMapRef && configMap(objs, f.configMapRef.name);
    if (cm && cm.data && n in cm.data) return cm.data[n];
  }
  return undefined;
}
const program = (c) => (c.command || [])[0];
// "10Gi", "512Mi", "1G", "3" -> bytes (or cores); NaN when it does not parse.
function quantity(q) {
  const m = /^([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T|m)?$/.exec(String(q ?? ''));
  if (!m) return NaN;
  const mult = { Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, k: 1e3, M: 1e6, G: 1e9, T: 1e12, m: 1e-3 };
  return Number(m[1]) * (m[2] ? mult[m[2]] : 1);
}
// A label selector with matchLabels and In/NotIn/Exists expressions.
function selectsAll(sel, labels) {
  if (!sel) return false;
  if (!Object.entries(sel.matchLabels || {}).every(([k, v]) => labels[k] === v)) return false;
  return (sel.matchExpressions || []).every((e) =>
    e.operator === 'In' ? (e.values || []).includes(labels[e.key]) :
    e.operator === 'NotIn' ? !(e.values || []).includes(labels[e.key]) :
    e.operator === 'Exists' ? e.key in labels : e.operator === 'DoesNotExist' ? !(e.key in labels) : false);
}
const isT4 = (ctx) => /(^|\/)t4/.test(ctx.dir);
const isWorker = (t) => labelsOf(t).app === 'llm-worker';
const hostPort = (ep) => {
  const m = /^tcp:\/\/([^:/]+):(\d+)$/.exec(ep || '');
  return m ? { host: m[1], port: Number(m[2]) } : null;
};

/* ---- the property checks: (objs, ctx) -> list of failures ---- */

const CHECKS = {
  // Every container: non-root, read-only root, no privilege escalation, no
  // capabilities, seccomp RuntimeDefault; no host namespaces or paths.
  securityContext(objs) {
    const f = [];
    for (const [o, t] of podTemplates(objs)) {
      const ps = t.spec.securityContext || {};
      if (t.spec.hostNetwork || t.spec.hostPID || t.spec.hostIPC) f.push(`${name(o)}: uses a host namespace`);
      for (const v of t.spec.volumes || []) if (v.hostPath) f.push(`${name(o)}: hostPath volume ${v.name}`);
      for (const c of containersOf(t)) {
        const s = c.securityContext || {};
        const where = `${name(o)} container ${c.name}`;
        if (!(s.runAsNonRoot ?? ps.runAsNonRoot)) f.push(`${where}: runAsNonRoot is not true`);
        if ((s.runAsUser ?? ps.runAsUser) === 0) f.push(`${where}: runs as uid 0`);
        if (s.readOnlyRootFilesystem !== true) f.push(`${where}: readOnlyRootFilesystem is not true`);
        if (s.allowPrivilegeEscalation !== false) f.push(`${where}: allowPrivilegeEscalation is not false`);
        if (s.privileged) f.push(`${where}: privileged`);
        if (!((s.capabilities || {}).drop || []).includes('ALL')) f.push(`${where}: capabilities do not drop ALL`);
        if ((s.capabilities || {}).add?.length) f.push(`${where}: adds capabilities`);
        if (((s.seccompProfile ?? ps.seccompProfile) || {}).type !== 'RuntimeDefault')
          f.push(`${where}: seccompProfile is not RuntimeDefault`);
      }
    }
    return f;
  },
  // Long-running containers: liveness and readiness; ours on /health and
  // /ready of the metrics port they listen on, Redis with redis-cli ping.
  probes(objs) {
    const f = [];
    for (const [o, t, longRunning] of podTemplates(objs)) {
      if (!longRunning) continue;
      for (const c of t.spec.containers) {
        const where = `${name(o)} container ${c.name}`;
        if (!c.livenessProbe || !c.readinessProbe) {
          f.push(`${where}: no ${c.livenessProbe ? 'readiness' : 'liveness'} probe`);
          continue;
        }
        if (['llm-router', 'llm-worker', 'llm-gateway'].includes(program(c))) {
          const listen = envSeen(objs, c, 'LLM_METRICS_LISTEN') || '';
          const port = Number(listen.split(':').pop());
          const metrics = (c.ports || []).find((p) => p.name === 'metrics');
          if (!metrics || metrics.containerPort !== port)
            f.push(`${where}: the port named metrics is not LLM_METRICS_LISTEN's (${listen})`);
          // /health fails until the loops turn (model loaded): a startup
          // probe on it must cover the start, or liveness would kill it.
          if (!c.startupProbe) f.push(`${where}: no startup probe (/health is 503 until the model is loaded)`);
          for (const [probe, path] of [['livenessProbe', '/health'], ['readinessProbe', '/ready'], ['startupProbe', '/health']]) {
            if (!c[probe]) continue;
            const g = c[probe].httpGet || {};
            if (g.path !== path || (g.port !== 'metrics' && g.port !== port))
              f.push(`${where}: ${probe} is not GET ${path} on the metrics port`);
          }
          const sp = c.startupProbe;
          const window = sp ? (sp.periodSeconds ?? 10) * (sp.failureThreshold ?? 3) : 0;
          if (program(c) === 'llm-worker' && window < 600)
            f.push(`${where}: the startup probe allows ${window} s for the model load, less than 600 s`);
        } else if (/redis/.test(c.image)) {
          // A long append-only file replay answers LOADING: liveness must
          // wait for a startup probe, or it kills Redis mid-replay.
          if (!c.startupProbe) f.push(`${where}: no startup probe (an AOF replay would meet liveness)`);
          for (const probe of ['livenessProbe', 'readinessProbe', 'startupProbe'])
            if (c[probe] && !JSON.stringify(c[probe].exec || {}).includes('redis-cli ping'))
              f.push(`${where}: ${probe} is not redis-cli ping`);
        }
      }
    }
    return f;
  },
  // A default-deny policy for both directions, and an allow policy that
  // selects each pod by its labels.
  networkPolicies(objs) {
    const f = [];
    const nps = objs.filter((o) => o.kind === 'NetworkPolicy');
    const deny = nps.find((p) => Object.keys(p.spec.podSelector || {}).length === 0 &&
      ['Ingress', 'Egress'].every((t) => (p.spec.policyTypes || []).includes(t)) && !p.spec.ingress && !p.spec.egress);
    if (!deny) f.push('no default-deny NetworkPolicy (podSelector {}, Ingress and Egress, no rules)');
    for (const [o, t] of podTemplates(objs)) {
      const sel = nps.filter((p) => Object.keys(p.spec.podSelector || {}).length > 0 && selects(p.spec.podSelector, labelsOf(t)));
      if (!sel.length) f.push(`${name(o)}: no NetworkPolicy selects its pods (labels ${JSON.stringify(labelsOf(t))})`);
    }
    return f;
  },
  // No secret material in what the repository renders: no Secret objects,
  // no password in a Redis URL, no literal API or CURVE keys in settings.
  noSecretValues(objs) {
    const f = [];
    for (const o of objs) if (o.kind === 'Secret') f.push(`${name(o)}: a Secret in the manifests (create it at deploy time)`);
    const z85 = /^[0-9A-Za-z.\-:+=^!/*?&<>()[\]{}@%$#]{40}$/;
    const look = (where, k, v) => {
      if (typeof v !== 'string') return;
      if (/^rediss?:\/\/[^/@]*:[^/@]*@/.test(v)) f.push(`${where}: ${k} holds a Redis password`);
      if (/^LLM_API_KEYS$|PASSWORD$|SECRET/.test(k)) f.push(`${where}: ${k} is set to a value (use a file from a Secret)`);
      if (z85.test(v)) f.push(`${where}: ${k} looks like a CURVE key`);
    };
    for (const o of objs) if (o.kind === 'ConfigMap') for (const [k, v] of Object.entries(o.data || {})) look(name(o), k, v);
    for (const [o, t] of podTemplates(objs))
      for (const c of containersOf(t)) for (const e of c.env || []) look(`${name(o)} container ${c.name}`, e.name, e.value);
    return f;
  },
  // Workers reach the router through a Service that publishes it while it
  // is not ready (it becomes ready only after workers register); clients
  // (gateways) through one that does not, without the worker port.
  registrationBeforeReady(objs) {
    const f = [];
    const router = podTemplates(objs).find(([, t]) => labelsOf(t).app === 'llm-router');
    if (!router) return ['no router pods'];
    const svcFor = (ep, who) => {
      const hp = hostPort(ep);
      if (!hp) return f.push(`${who}: LLM_ROUTER '${ep}' is not tcp://SERVICE:PORT`), null;
      const s = objs.find((o) => o.kind === 'Service' && o.metadata.name === hp.host);
      if (!s) return f.push(`${who}: LLM_ROUTER names ${hp.host}, which is not a Service here`), null;
      if (!selects({ matchLabels: s.spec.selector }, labelsOf(router[1]))) f.push(`${who}: Service ${hp.host} does not select the router`);
      if (!s.spec.ports.some((p) => p.port === hp.port)) f.push(`${who}: Service ${hp.host} has no port ${hp.port}`);
      return s;
    };
    for (const [o, t] of podTemplates(objs)) {
      for (const c of t.spec.containers) {
        if (program(c) === 'llm-worker') {
          const s = svcFor(envSeen(objs, c, 'LLM_ROUTER'), name(o));
          if (s && s.spec.publishNotReadyAddresses !== true)
            f.push(`${name(o)}: workers register through Service ${s.metadata.name}, which has no publishNotReadyAddresses: true`);
        } else if (program(c) === 'llm-gateway') {
          const s = svcFor(envSeen(objs, c, 'LLM_ROUTER'), name(o));
          if (s && s.spec.publishNotReadyAddresses) f.push(`${name(o)}: clients reach a router that is not ready (${s.metadata.name})`);
          if (s && s.spec.ports.some((p) => p.port === 5556)) f.push(`Service ${s.metadata.name}: the client Service exposes the worker port`);
        }
      }
    }
    return f;
  },
  // Every image is one of the kustomization's images: entries, and every
  // entry is used, so a registry override reaches every container.
  imagesOverridable(objs, ctx) {
    const f = [];
    const full = (e) => (e.newName || e.name) + (e.digest ? '@' + e.digest : e.newTag ? ':' + e.newTag : '');
    const used = new Set();
    for (const [o, t] of podTemplates(objs))
      for (const c of containersOf(t)) {
        const es = ctx.images.filter((x) => full(x) === c.image);
        if (!es.length) f.push(`${name(o)} container ${c.name}: image ${c.image} is not from the images: list of ${ctx.dir}`);
        for (const e of es) used.add(e.name);
      }
    for (const e of ctx.images) if (!used.has(e.name)) f.push(`${ctx.dir}: images: entry ${e.name} matches no container`);
    if (!ctx.images.length) f.push(`${ctx.dir}: no images: list`);
    return f;
  },
  // A worker gets the time its drain takes before SIGKILL.
  workerGracePeriod(objs) {
    const f = [];
    for (const [o, t] of podTemplates(objs))
      if (isWorker(t) && !((t.spec.terminationGracePeriodSeconds ?? 30) * 1000 >= drainMs))
        f.push(`${name(o)}: terminationGracePeriodSeconds ${t.spec.terminationGracePeriodSeconds ?? 30} < the drain's ${drainMs / 1000} s (NODE_DRAIN_MAX_MS)`);
    return f;
  },
  // A pipeline has LLM_STAGES stages, one pod each, stage k on pod k.
  pipelineShape(objs) {
    const f = [];
    const cfg = configMap(objs, 'llm-config');
    const workers = podTemplates(objs).filter(([, t]) => isWorker(t));
    if (!workers.length) return f;
    const stages = Number(cfg?.data?.LLM_STAGES);
    for (const o of objs.filter((x) => x.kind === 'LeaderWorkerSet')) {
      const lt = o.spec.leaderWorkerTemplate;
      if (lt.size !== stages) f.push(`${name(o)}: size ${lt.size} != LLM_STAGES ${stages}`);
      if (lt.restartPolicy !== 'RecreateGroupOnPodRestart') f.push(`${name(o)}: restartPolicy is not RecreateGroupOnPodRestart`);
      const c = lt.workerTemplate.spec.containers[0];
      for (const [n, label] of [['LLM_PIPELINE', 'group-index'], ['LLM_STAGE', 'worker-index']]) {
        const e = (c.env || []).find((x) => x.name === n);
        if (e?.valueFrom?.fieldRef?.fieldPath !== `metadata.labels['leaderworkerset.sigs.k8s.io/${label}']`)
          f.push(`${name(o)}: ${n} is not the LWS ${label} label`);
      }
    }
    const sts = workers.filter(([o]) => o.kind === 'StatefulSet');
    if (sts.length) {
      const seen = sts.map(([, t]) => Number(envValue(t.spec.containers[0], 'LLM_STAGE'))).sort((a, b) => a - b);
      if (seen.join() !== [...Array(stages).keys()].join())
        f.push(`stage StatefulSets have LLM_STAGE ${seen.join(',')}, not 0..${stages - 1} (LLM_STAGES ${stages})`);
    }
    return f;
  },
  // KEDA scales the LeaderWorkerSet on the routers' consumer group, with
  // the password of the Secret Redis uses.
  autoscaling(objs) {
    const f = [];
    const lws = objs.filter((o) => o.kind === 'LeaderWorkerSet');
    const sos = objs.filter((o) => o.kind === 'ScaledObject');
    if (lws.length && !sos.length) f.push('LeaderWorkerSet without a ScaledObject');
    const redis = podTemplates(objs).find(([, t]) => labelsOf(t).app === 'redis');
    const redisSecret = redis && (redis[1].spec.volumes || []).find((v) => v.secret)?.secret.secretName;
    const prefix = configMap(objs, 'llm-config')?.data?.LLM_REDIS_PREFIX ?? 'llm:';
    for (const so of sos) {
      const ref = so.spec.scaleTargetRef;
      if (!lws.some((l) => l.metadata.name === ref.name && l.apiVersion === ref.apiVersion && ref.kind === 'LeaderWorkerSet'))
        f.push(`${name(so)}: scaleTargetRef is not a LeaderWorkerSet here`);
      if (!(so.spec.minReplicaCount >= 1 && so.spec.maxReplicaCount >= so.spec.minReplicaCount))
        f.push(`${name(so)}: min/max pipelines ${so.spec.minReplicaCount}/${so.spec.maxReplicaCount}`);
      for (const tr of so.spec.triggers) {
        if (tr.type !== 'redis-streams') { f.push(`${name(so)}: trigger ${tr.type}`); continue; }
        const m = tr.metadata;
        if (m.stream !== prefix + 'requests') f.push(`${name(so)}: stream ${m.stream}, the router's is ${prefix}requests`);
        if (m.consumerGroup !== routerGroup) f.push(`${name(so)}: consumerGroup ${m.consumerGroup}, the router's is ${routerGroup}`);
        if (!m.pendingEntriesCount && !m.lagCount) f.push(`${name(so)}: neither pendingEntriesCount nor lagCount`);
        if (m.password) f.push(`${name(so)}: a password in the trigger's metadata`);
        const ta = objs.find((o) => o.kind === 'TriggerAuthentication' && o.metadata.name === tr.authenticationRef?.name);
        if (!ta) { f.push(`${name(so)}: authenticationRef names no TriggerAuthentication here`); continue; }
        const pw = (ta.spec.secretTargetRef || []).find((s) => s.parameter === 'password');
        if (!pw || pw.name !== redisSecret) f.push(`${name(ta)}: password is not from Redis's Secret ${redisSecret}`);
      }
    }
    return f;
  },
  // Every Secret and ConfigMap a pod needs exists in the manifests or is
  // one that docs/deploy.md says how to create.
  referencesDocumented(objs) {
    const f = [];
    const refs = new Set();
    for (const [, t] of podTemplates(objs)) {
      for (const v of t.spec.volumes || []) {
        if (v.secret) refs.add(`secret generic ${v.secret.secretName}`);
        if (v.configMap) refs.add(`configmap ${v.configMap.name}`);
      }
      for (const c of containersOf(t)) {
        for (const e of c.envFrom || []) if (e.configMapRef) refs.add(`configmap ${e.configMapRef.name}`);
        for (const e of c.env || []) {
          if (e.valueFrom?.configMapKeyRef) refs.add(`configmap ${e.valueFrom.configMapKeyRef.name}`);
          if (e.valueFrom?.secretKeyRef) refs.add(`secret generic ${e.valueFrom.secretKeyRef.name}`);
        }
      }
    }
    for (const o of objs) for (const s of o.spec?.secretTargetRef || []) refs.add(`secret generic ${s.name}`);
    for (const r of refs) {
      const [kind, n] = [r.startsWith('secret') ? 'Secret' : 'ConfigMap', r.split(' ').pop()];
      if (objs.some((o) => o.kind === kind && o.metadata.name === n)) continue;
      if (!deployDoc.includes(`create ${r} `)) f.push(`${kind} ${n} is used but neither in the manifests nor created in docs/deploy.md (kubectl create ${r} ...)`);
    }
    return f;
  },
  // The LLM_* settings are ones the programs know (a misspelt one would be
  // ignored without a word).
  settingsKnown(objs) {
    const f = [];
    const check = (prog, n, where) => {
      if (!helps[prog] || helps[prog].has(n)) return;
      if (contractNames.has(n)) notes.add(`${prog} does not list ${n} yet (agreed interface)`);
      else f.push(`${where}: ${n} is not in ${prog} --help`);
    };
    const consumers = {};
    for (const [o, t] of podTemplates(objs))
      for (const c of t.spec.containers) {
        const prog = program(c);
        if (!helps[prog]) continue;
        for (const e of c.env || []) if (e.name.startsWith('LLM_')) check(prog, e.name, `${name(o)} container ${c.name}`);
        for (const e of c.envFrom || []) if (e.configMapRef) (consumers[e.configMapRef.name] ||= new Set()).add(prog);
      }
    for (const [cm, progs] of Object.entries(consumers))
      for (const k of Object.keys(configMap(objs, cm)?.data || {}))
        if (k.startsWith('LLM_') && ![...progs].some((p) => helps[p].has(k) || contractNames.has(k)))
          f.push(`ConfigMap/${cm}: ${k} is in no --help of ${[...progs].join(', ')}`);
    return f;
  },
  // T4: one GPU per worker, /dev/shm in memory, NCCL over sockets, only on
  // T4 nodes; CPU: no GPU asked for anywhere.
  hardware(objs, ctx) {
    const f = [];
    for (const [o, t] of podTemplates(objs)) {
      for (const c of t.spec.containers) {
        const gpu = (c.resources?.limits || {})['nvidia.com/gpu'];
        if (!ctx.dir.includes('t4')) {
          if (gpu !== undefined) f.push(`${name(o)}: asks for a GPU in ${ctx.dir}`);
          continue;
        }
        if (!isWorker(t)) { if (gpu !== undefined) f.push(`${name(o)}: not a worker, asks for a GPU`); continue; }
        if (String(gpu) !== '1') f.push(`${name(o)}: nvidia.com/gpu limit is ${gpu}, not 1`);
        const shm = (c.volumeMounts || []).find((m) => m.mountPath === '/dev/shm');
        const vol = shm && t.spec.volumes.find((v) => v.name === shm.name);
        if (vol?.emptyDir?.medium !== 'Memory') f.push(`${name(o)}: /dev/shm is not a memory emptyDir`);
        for (const [k, v] of [['NCCL_IB_DISABLE', '1'], ['NCCL_P2P_DISABLE', '1'], ['NCCL_SHM_DISABLE', '1']])
          if (envSeen(objs, c, k) !== v) f.push(`${name(o)}: ${k} is not ${v}`);
        if (!envSeen(objs, c, 'NCCL_SOCKET_IFNAME')) f.push(`${name(o)}: no NCCL_SOCKET_IFNAME`);
        if (envSeen(objs, c, 'LLM_REQUIRE_GPU') !== 'true') f.push(`${name(o)}: LLM_REQUIRE_GPU is not true`);
        const terms = t.spec.affinity?.nodeAffinity?.requiredDuringSchedulingIgnoredDuringExecution?.nodeSelectorTerms || [];
        if (!JSON.stringify(terms).includes('nvidia-tesla-t4') || !JSON.stringify(terms).includes('Tesla-T4'))
          f.push(`${name(o)}: not limited to T4 nodes`);
        if (!(t.spec.tolerations || []).some((x) => x.key === 'nvidia.com/gpu')) f.push(`${name(o)}: no nvidia.com/gpu toleration`);
        if (!(t.spec.topologySpreadConstraints || []).length) f.push(`${name(o)}: no topology spread`);
      }
    }
    return f;
  },
  // Nothing KEDA or an HPA scales carries replicas: kubectl apply -k would
  // reset what the autoscaler chose.
  noReplicasWhenAutoscaled(objs) {
    const f = [];
    for (const a of objs.filter((o) => o.kind === 'HorizontalPodAutoscaler' || o.kind === 'ScaledObject')) {
      const ref = a.spec.scaleTargetRef || {};
      const kind = ref.kind || 'Deployment';
      const t = objs.find((o) => o.kind === kind && o.metadata.name === ref.name);
      if (t && t.spec.replicas !== undefined)
        f.push(`${name(t)}: replicas ${t.spec.replicas} set, but ${name(a)} scales it`);
    }
    return f;
  },
  // A rollout surges a new pipeline before it takes an old one down, and
  // production (T4) keeps at least 2 pipelines.
  pipelineAvailability(objs, ctx) {
    const f = [];
    for (const o of objs.filter((x) => x.kind === 'LeaderWorkerSet')) {
      const ru = o.spec.rolloutStrategy?.rollingUpdateConfiguration || {};
      if (!(Number(ru.maxSurge) >= 1)) f.push(`${name(o)}: maxSurge ${ru.maxSurge ?? 0}, a rollout empties a pipeline before its replacement loads`);
    }
    if (isT4(ctx))
      for (const so of objs.filter((x) => x.kind === 'ScaledObject'))
        if (!(so.spec.minReplicaCount >= 2)) f.push(`${name(so)}: minReplicaCount ${so.spec.minReplicaCount}, production needs 2 pipelines`);
    return f;
  },
  // Every worker waits in an init container for LLM_MODEL on the same
  // volume, instead of exiting (and recreating its group) without it.
  workerWaitsForModel(objs) {
    const f = [];
    for (const [o, t] of podTemplates(objs)) {
      if (!isWorker(t)) continue;
      const w = t.spec.containers.find((c) => program(c) === 'llm-worker');
      if (!w) continue;
      const model = envSeen(objs, w, 'LLM_MODEL');
      const mount = (w.volumeMounts || []).find((m) => model && model.startsWith(m.mountPath.replace(/\/?$/, '/')));
      const ok = (t.spec.initContainers || []).some((ic) => {
        const im = (ic.volumeMounts || []).find((m) => mount && m.name === mount.name && m.mountPath === mount.mountPath);
        return im && envSeen(objs, ic, 'LLM_MODEL') === model && JSON.stringify([ic.command, ic.args]).includes('$LLM_MODEL');
      });
      if (!ok) f.push(`${name(o)}: no init container waits for ${model} on the worker's volume ${mount?.name}`);
    }
    return f;
  },
  // Egress to port 53 only to the cluster's DNS.
  dnsDestination(objs) {
    const f = [];
    for (const p of objs.filter((o) => o.kind === 'NetworkPolicy'))
      for (const r of p.spec.egress || []) {
        if (!(r.ports || []).some((x) => x.port === 53)) continue;
        if (!r.to?.length) { f.push(`${name(p)}: port 53 open to every address (no to:)`); continue; }
        for (const peer of r.to) {
          const dnsPods = peer.podSelector && ['kube-dns', 'node-local-dns'].includes(peer.podSelector.matchLabels?.['k8s-app']) &&
            peer.namespaceSelector?.matchLabels?.['kubernetes.io/metadata.name'] === 'kube-system';
          const host = peer.ipBlock && /\/32$/.test(peer.ipBlock.cidr);
          if (!dnsPods && !host) f.push(`${name(p)}: port 53 to ${JSON.stringify(peer)}, not the cluster's DNS`);
        }
      }
    return f;
  },
  // The fill Job: bounded in time, a download that gives up, written as the
  // cluster's uid, and egress only outside the cluster: not the metadata
  // servers' link-local range nor the private ranges of pods and nodes.
  modelFill(objs) {
    const f = [];
    const jobs = objs.filter((o) => o.kind === 'Job' && labelsOf(o.spec.template).app === 'llm-model-fill');
    const must = ['169.254.0.0/16', '10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16'];
    for (const j of jobs) {
      const t = j.spec.template;
      if (!(j.spec.activeDeadlineSeconds > 0)) f.push(`${name(j)}: no activeDeadlineSeconds`);
      const cmd = JSON.stringify(t.spec.containers.map((c) => [c.command, c.args]));
      if (!/--connect-timeout/.test(cmd) || !(/--speed-time/.test(cmd) || /--max-time/.test(cmd)))
        f.push(`${name(j)}: the download has no timeout (curl --connect-timeout and --speed-time or --max-time)`);
      const uid = t.spec.containers[0].securityContext?.runAsUser ?? t.spec.securityContext?.runAsUser;
      if (uid !== clusterUid) f.push(`${name(j)}: writes as uid ${uid}, not ${clusterUid} (the uid the provider storage lets write)`);
      const nps = objs.filter((p) => p.kind === 'NetworkPolicy' && Object.keys(p.spec.podSelector || {}).length &&
        selectsAll(p.spec.podSelector, labelsOf(t)) && (p.spec.policyTypes || []).includes('Egress'));
      if (!nps.length) f.push(`${name(j)}: no egress policy of its own`);
      for (const p of nps)
        for (const r of p.spec.egress || []) {
          if (!r.to?.length) { f.push(`${name(p)}: egress to every address`); continue; }
          for (const peer of r.to) {
            if (!peer.ipBlock) { f.push(`${name(p)}: egress to cluster pods ${JSON.stringify(peer)}`); continue; }
            if (peer.ipBlock.cidr === '0.0.0.0/0')
              for (const m of must) if (!(peer.ipBlock.except || []).includes(m)) f.push(`${name(p)}: egress reaches ${m}`);
          }
        }
    }
    return f;
  },
  // With the monitoring kustomization: a PodMonitor scrapes every metrics
  // port of every pod that has one.
  podMonitors(objs, ctx) {
    const f = [];
    if (!ctx.monitored) return f;
    const pms = objs.filter((o) => o.kind === 'PodMonitor');
    if (!pms.length) return ['monitoring asked for, but no PodMonitor'];
    for (const [o, t] of podTemplates(objs))
      for (const c of t.spec.containers)
        for (const port of (c.ports || []).filter((p) => p.name === 'metrics')) {
          const ok = pms.some((pm) => selectsAll(pm.spec.selector, labelsOf(t)) &&
            (pm.spec.podMetricsEndpoints || []).some((e) => e.port === port.name && (e.path ?? '/metrics') === '/metrics'));
          if (!ok) f.push(`${name(o)}: metrics port ${port.containerPort} is in no PodMonitor`);
        }
    return f;
  },
  // T4: a worker's memory fits the smallest T4 hosts (16 GiB).
  workerMemory(objs, ctx) {
    const f = [];
    if (!isT4(ctx)) return f;
    for (const [o, t] of podTemplates(objs)) {
      if (!isWorker(t)) continue;
      const r = t.spec.containers[0].resources || {};
      const req = quantity(r.requests?.memory), lim = quantity(r.limits?.memory);
      if (!(req <= t4WorkerRequestMax)) f.push(`${name(o)}: memory request ${r.requests?.memory} > 10Gi, more than a 16 GiB T4 host has for it`);
      if (!(lim <= t4WorkerLimitMax)) f.push(`${name(o)}: memory limit ${r.limits?.memory} > 12Gi, above a 16 GiB T4 host`);
      if (!(lim >= req)) f.push(`${name(o)}: memory limit below the request`);
    }
    return f;
  },
  // T4: the models claim is ReadWriteMany; in a provider overlay its
  // storage is defined here and lets the cluster's uid write.
  storage(objs, ctx) {
    const f = [];
    if (!isT4(ctx)) return f;
    const pvc = objs.find((o) => o.kind === 'PersistentVolumeClaim' && o.metadata.name === 'llm-models');
    if (!pvc) return ['no PersistentVolumeClaim llm-models'];
    if (!(pvc.spec.accessModes || []).includes('ReadWriteMany')) f.push(`${name(pvc)}: not ReadWriteMany`);
    const provider = providerOverlays.find((p) => ctx.dir.includes(`overlays/${p}`));
    if (!provider) {
      if (!deployDoc.includes(pvc.spec.storageClassName)) f.push(`${name(pvc)}: class ${pvc.spec.storageClassName} is not in docs/deploy.md`);
      return f;
    }
    const uid = String(clusterUid);
    if (pvc.spec.storageClassName === '') {
      const pv = objs.find((o) => o.kind === 'PersistentVolume' && o.metadata.name === pvc.spec.volumeName);
      if (!pv) return [...f, `${name(pvc)}: volumeName ${pvc.spec.volumeName} is no PersistentVolume here`];
      if (!(pv.spec.accessModes || []).includes('ReadWriteMany')) f.push(`${name(pv)}: not ReadWriteMany`);
      if (pv.spec.claimRef?.name !== 'llm-models' || pv.spec.claimRef?.namespace !== pvc.metadata.namespace)
        f.push(`${name(pv)}: not reserved for ${pvc.metadata.namespace}/llm-models`);
      if (!pv.spec.nfs || /^\/[^/]*\/?$/.test(pv.spec.nfs.path))
        f.push(`${name(pv)}: not a prepared directory below the share's root (root-owned)`);
      return f;
    }
    const sc = objs.find((o) => o.kind === 'StorageClass' && o.metadata.name === pvc.spec.storageClassName);
    if (!sc) return [...f, `${name(pvc)}: class ${pvc.spec.storageClassName} is not defined in ${ctx.dir}`];
    const p = sc.parameters || {}, mo = sc.mountOptions || [];
    const writable = sc.provisioner === 'efs.csi.aws.com' ? p.provisioningMode === 'efs-ap' && p.uid === uid && p.gid === uid
      : sc.provisioner === 'file.csi.azure.com' ? mo.includes(`uid=${uid}`) && mo.includes(`gid=${uid}`)
      : false;
    if (!writable) f.push(`${name(sc)}: ${sc.provisioner} does not hand the share to uid/gid ${uid}`);
    return f;
  },
};

// The GKE share preparation: root with CAP_CHOWN, so outside the restricted
// namespace, in one of its own at the baseline level, and nothing more.
const PREPARE_CHECKS = {
  prepareOutsideRestricted(objs) {
    const f = [];
    const ns = objs.find((o) => o.kind === 'Namespace');
    const level = ns?.metadata?.labels?.['pod-security.kubernetes.io/enforce'];
    if (!ns || level !== 'baseline') f.push(`the preparation's namespace enforces ${level}, not baseline`);
    for (const [o, t] of podTemplates(objs)) {
      if (o.metadata.namespace === 'llm' || o.metadata.namespace !== ns?.metadata?.name)
        f.push(`${name(o)}: in namespace ${o.metadata.namespace}, not the preparation's own`);
      for (const c of containersOf(t)) {
        const sc = c.securityContext || {};
        if (sc.privileged || sc.allowPrivilegeEscalation !== false) f.push(`${name(o)}: privileged or may escalate`);
        const add = sc.capabilities?.add || [];
        if (add.some((x) => x !== 'CHOWN') || !(sc.capabilities?.drop || []).includes('ALL'))
          f.push(`${name(o)}: capabilities beyond CHOWN`);
        if (!JSON.stringify(c.command).includes(`chown ${clusterUid}:${clusterUid}`)) f.push(`${name(o)}: does not give the directory to ${clusterUid}`);
      }
    }
    return f;
  },
};

/* ---- breaking things on purpose: each mutation must trip its check ---- */

const workerT = (objs) => podTemplates(objs).find(([, t]) => isWorker(t))?.[1];
const routerT = (objs) => podTemplates(objs).find(([, t]) => labelsOf(t).app === 'llm-router')[1];
const MUTATIONS = [
  ['securityContext', 'a container may escalate', (o) => { routerT(o).spec.containers[0].securityContext.allowPrivilegeEscalation = true; }],
  ['securityContext', 'a writable root', (o) => { delete routerT(o).spec.containers[0].securityContext.readOnlyRootFilesystem; }],
  ['securityContext', 'no seccomp', (o) => { const t = routerT(o); delete t.spec.containers[0].securityContext.seccompProfile; delete t.spec.securityContext.seccompProfile; }],
  ['securityContext', 'capabilities kept', (o) => { routerT(o).spec.containers[0].securityContext.capabilities = {}; }],
  ['probes', 'no readiness probe', (o) => { delete routerT(o).spec.containers[0].readinessProbe; }],
  ['probes', 'readiness on /health', (o) => { routerT(o).spec.containers[0].readinessProbe.httpGet.path = '/health'; }],
  ['networkPolicies', 'no default deny', (o) => { o.splice(o.findIndex((x) => x.kind === 'NetworkPolicy' && x.metadata.name === 'default-deny'), 1); }],
  ['networkPolicies', 'an unselected pod', (o) => { routerT(o).metadata.labels = { app: 'something-else' }; }],
  ['noSecretValues', 'a Secret object', (o) => { o.push({ apiVersion: 'v1', kind: 'Secret', metadata: { name: 'x' }, data: { password: 'eA==' } }); }],
  ['noSecretValues', 'a password in the Redis URL', (o) => { configMap(o, 'llm-config').data.LLM_REDIS = 'redis://:hunter2@redis:6379'; }],
  ['registrationBeforeReady', 'worker Service hides a not-ready router', (o) => { o.find((x) => x.kind === 'Service' && x.metadata.name === 'llm-router-workers').spec.publishNotReadyAddresses = false; }],
  ['registrationBeforeReady', 'workers through the client Service', (o) => { for (const [, t] of podTemplates(o)) if (isWorker(t)) t.spec.containers[0].env.find((e) => e.name === 'LLM_ROUTER').value = 'tcp://llm-router:5555'; }],
  ['imagesOverridable', 'an image outside the list', (o) => { routerT(o).spec.containers[0].image = 'docker.io/someone/llm:latest'; }],
  ['workerGracePeriod', 'a short grace period', (o) => { workerT(o).spec.terminationGracePeriodSeconds = 30; }],
  ['pipelineShape', 'stages != LLM_STAGES', (o) => { configMap(o, 'llm-config').data.LLM_STAGES = '3'; }],
  ['autoscaling', 'the wrong consumer group', (o) => { o.find((x) => x.kind === 'ScaledObject').spec.triggers[0].metadata.consumerGroup = 'router'; }, (o) => o.some((x) => x.kind === 'ScaledObject')],
  ['referencesDocumented', 'an undocumented Secret', (o) => { routerT(o).spec.volumes.push({ name: 'x', secret: { secretName: 'llm-undocumented' } }); }],
  ['settingsKnown', 'a misspelt setting', (o) => { routerT(o).spec.containers[0].env.push({ name: 'LLM_ROUTERID', value: 'x' }); }, () => !!helps['llm-router']],
  ['hardware', 'a GPU in the CPU overlay / two GPUs on T4', (o, ctx) => { const c = workerT(o).spec.containers[0]; c.resources = { limits: { 'nvidia.com/gpu': ctx.dir.includes('t4') ? 2 : 1 } }; }],
  ['probes', 'a worker without a startup probe', (o) => { delete workerT(o).spec.containers[0].startupProbe; }, (o) => !!workerT(o)],
  ['probes', 'a 1-minute model load', (o) => { workerT(o).spec.containers[0].startupProbe.failureThreshold = 6; }, (o) => !!workerT(o)],
  ['probes', 'Redis without a startup probe', (o) => { delete podTemplates(o).find(([, t]) => labelsOf(t).app === 'redis')[1].spec.containers[0].startupProbe; }],
  ['noReplicasWhenAutoscaled', 'replicas on the autoscaled LeaderWorkerSet', (o) => { o.find((x) => x.kind === 'LeaderWorkerSet').spec.replicas = 1; }, (o) => o.some((x) => x.kind === 'ScaledObject')],
  ['noReplicasWhenAutoscaled', 'replicas on the gateways the HPA scales', (o) => { o.find((x) => x.kind === 'Deployment' && x.metadata.name === 'llm-gateway').spec.replicas = 2; }],
  ['pipelineAvailability', 'maxSurge 0', (o) => { o.find((x) => x.kind === 'LeaderWorkerSet').spec.rolloutStrategy.rollingUpdateConfiguration.maxSurge = 0; }, (o) => o.some((x) => x.kind === 'LeaderWorkerSet')],
  ['pipelineAvailability', 'one pipeline on T4', (o) => { o.find((x) => x.kind === 'ScaledObject').spec.minReplicaCount = 1; }, (o, ctx) => isT4(ctx) && o.some((x) => x.kind === 'ScaledObject')],
  ['workerWaitsForModel', 'no init container', (o) => { for (const [, t] of podTemplates(o)) if (isWorker(t)) delete t.spec.initContainers; }, (o) => !!workerT(o)],
  ['workerWaitsForModel', 'waiting on another volume', (o) => { workerT(o).spec.initContainers[0].volumeMounts[0].mountPath = '/elsewhere'; }, (o) => !!workerT(o)],
  ['dnsDestination', 'port 53 to anywhere', (o) => { delete o.find((x) => x.kind === 'NetworkPolicy' && x.metadata.name === 'allow-dns').spec.egress[0].to; }],
  ['dnsDestination', 'port 53 to a whole range', (o) => { o.find((x) => x.kind === 'NetworkPolicy' && x.metadata.name === 'allow-dns').spec.egress[0].to = [{ ipBlock: { cidr: '0.0.0.0/0' } }]; }],
  ['modelFill', 'the fill Job reaches the metadata server', (o) => { o.find((x) => x.metadata.name === 'llm-model-fill' && x.kind === 'NetworkPolicy').spec.egress[0].to[0].ipBlock.except = ['10.0.0.0/8']; }, (o) => o.some((x) => x.kind === 'Job')],
  ['modelFill', 'the fill Job reaches any address', (o) => { delete o.find((x) => x.metadata.name === 'llm-model-fill' && x.kind === 'NetworkPolicy').spec.egress[0].to; }, (o) => o.some((x) => x.kind === 'Job')],
  ['modelFill', 'no deadline', (o) => { delete o.find((x) => x.kind === 'Job').spec.activeDeadlineSeconds; }, (o) => o.some((x) => x.kind === 'Job')],
  ['modelFill', 'a download without a timeout', (o) => { const c = o.find((x) => x.kind === 'Job').spec.template.spec.containers[0]; c.args = c.args.map((a) => a.replace(/--connect-timeout \d+ /, '')); }, (o) => o.some((x) => x.kind === 'Job')],
  ['modelFill', 'the fill Job as uid 100', (o) => { o.find((x) => x.kind === 'Job').spec.template.spec.securityContext.runAsUser = 100; }, (o) => o.some((x) => x.kind === 'Job')],
  ['podMonitors', 'workers left unscraped', (o) => { o.find((x) => x.kind === 'PodMonitor').spec.selector.matchExpressions[0].values = ['llm-router', 'llm-gateway']; }, (o, ctx) => ctx.monitored],
  ['podMonitors', 'the wrong port name', (o) => { o.find((x) => x.kind === 'PodMonitor').spec.podMetricsEndpoints[0].port = 'http'; }, (o, ctx) => ctx.monitored],
  ['workerMemory', 'a 24Gi limit on T4', (o) => { workerT(o).spec.containers[0].resources.limits.memory = '24Gi'; }, (o, ctx) => isT4(ctx)],
  ['workerMemory', 'a 12Gi request on T4', (o) => { workerT(o).spec.containers[0].resources.requests.memory = '12Gi'; }, (o, ctx) => isT4(ctx)],
  ['storage', 'a class no provider has', (o) => { o.find((x) => x.kind === 'PersistentVolumeClaim').spec.storageClassName = 'efs-sc'; o.find((x) => x.kind === 'PersistentVolumeClaim').spec.volumeName = undefined; }, (o, ctx) => providerOverlays.some((p) => ctx.dir.includes(p))],
  ['storage', 'a share left to root', (o) => { const sc = o.find((x) => x.kind === 'StorageClass'); if (sc) { sc.parameters = { ...sc.parameters, uid: '0' }; sc.mountOptions = (sc.mountOptions || []).map((m) => m.replace('uid=10001', 'uid=0')); } else o.find((x) => x.kind === 'PersistentVolume').spec.nfs.path = '/vol1'; }, (o, ctx) => providerOverlays.some((p) => ctx.dir.includes(p))],
  ['storage', 'ReadWriteOnce on T4', (o) => { o.find((x) => x.kind === 'PersistentVolumeClaim').spec.accessModes = ['ReadWriteOnce']; }, (o, ctx) => isT4(ctx)],
];
const PREPARE_MUTATIONS = [
  ['prepareOutsideRestricted', 'a privileged namespace', (o) => { o.find((x) => x.kind === 'Namespace').metadata.labels['pod-security.kubernetes.io/enforce'] = 'privileged'; }],
  ['prepareOutsideRestricted', 'in the namespace llm', (o) => { o.find((x) => x.kind === 'Job').metadata.namespace = 'llm'; }],
  ['prepareOutsideRestricted', 'SYS_ADMIN too', (o) => { o.find((x) => x.kind === 'Job').spec.template.spec.containers[0].securityContext.capabilities.add.push('SYS_ADMIN'); }],
];

/* ---- run ---- */

let failures = 0;
const fail = (msg) => { failures++; console.log(`FAIL ${msg}`); };

// Files that must stay equal across the T4 overlays (kustomize loads no
// file from outside an overlay's directory, so they are copies).
for (const f of ['config.yaml', 'models-pvc.yaml']) {
  const a = readFileSync(join(overlaysDir, 't4', f), 'utf8'), b = readFileSync(join(overlaysDir, 't4-statefulset', f), 'utf8');
  if (a !== b) fail(`deploy/k8s/overlays/t4/${f} and t4-statefulset/${f} differ`);
}

// The dashboard shows every documented metric.
{
  const dash = JSON.parse(readFileSync(join(root, 'deploy/grafana/llm-dashboard.json'), 'utf8'));
  const exprs = JSON.stringify(dash.panels.flatMap((p) => (p.targets || []).map((t) => t.expr)));
  let n = 0;
  for (const doc of ['docs/metrics.md', 'docs/gateway.md'])
    for (const [, m] of readFileSync(join(root, doc), 'utf8').matchAll(/^\| `(llm_[a-z0-9_]+)/gm)) {
      n++;
      if (!new RegExp(`\\b${m}(_bucket)?\\b`).test(exprs)) fail(`deploy/grafana/llm-dashboard.json: no panel shows ${m} (${doc})`);
    }
  if (n < 10) fail(`found only ${n} metrics in docs/metrics.md and docs/gateway.md`);
  console.log(`dashboard: ${dash.panels.length} panels, ${n} documented metrics shown`);
}

for (const dirs of targets) {
  const dir = dirs.join(' + ');
  let objs = [];
  try {
    for (const d of dirs) objs = objs.concat(render(d));
  } catch (e) {
    fail(`${dir}: kubectl kustomize failed: ${(e.stderr || e.message).toString().slice(0, 2000)}`);
    continue;
  }
  const ctx = { dir, images: dirs.flatMap(imageEntries), monitored: dirs.some((d) => d.endsWith('/monitoring')) };
  let bad = 0;
  for (const o of objs) {
    const err = await validateSchema(o);
    if (err) { bad++; fail(`${dir}: ${name(o)} does not validate: ${err}`); }
  }
  const kinds = {};
  for (const o of objs) kinds[o.kind] = (kinds[o.kind] || 0) + 1;
  console.log(`${dir}: ${objs.length} objects (${Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(', ')}), ${objs.length - bad} valid`);
  for (const [check, fn] of Object.entries(CHECKS))
    for (const msg of fn(objs, ctx)) fail(`${dir}: ${check}: ${msg}`);
  // The checks must catch a break.  Mutations that need an object this
  // target lacks (a worker in model-fill) are skipped for it.
  let tried = 0, missed = 0;
  for (const [check, what, mutate, applies] of MUTATIONS) {
    const copy = structuredClone(objs);
    try {
      if (applies && !applies(copy, ctx)) continue;
      mutate(copy, ctx);
    } catch {
      continue;
    }
    tried++;
    if (!CHECKS[check](copy, ctx).length) { missed++; fail(`${dir}: ${check} did not notice: ${what}`); }
  }
  // The schemas must refuse a wrong object too.
  for (const [kind, what, mutate] of [
    ['LeaderWorkerSet', 'an unknown restartPolicy', (o) => { o.spec.leaderWorkerTemplate.restartPolicy = 'Sometimes'; }],
    ['LeaderWorkerSet', 'a string size', (o) => { o.spec.leaderWorkerTemplate.size = 'two'; }],
    ['ScaledObject', 'a string minReplicaCount', (o) => { o.spec.minReplicaCount = 'one'; }],
    ['Deployment', 'a string replicas', (o) => { o.spec.replicas = 'two'; }],
    ['NetworkPolicy', 'an unknown policy type', (o) => { o.spec.policyTypes = ['Sideways']; }],
    ['PodMonitor', 'a numeric endpoint list', (o) => { o.spec.podMetricsEndpoints = 9465; }],
    ['StorageClass', 'a numeric provisioner', (o) => { o.provisioner = 5; }],
  ]) {
    const o = objs.find((x) => x.kind === kind);
    if (!o) continue;
    const copy = structuredClone(o);
    mutate(copy);
    tried++;
    if (!(await validateSchema(copy))) { missed++; fail(`${dir}: the ${kind} schema accepted ${what}`); }
  }
  console.log(`${dir}: ${tried} deliberate breaks, ${missed ? missed + ' not caught' : 'each caught'}`);
}
for (const p of providerOverlays)
  if (!targets.some((t) => t[0] === `deploy/k8s/overlays/${p}`)) fail(`deploy/k8s/overlays/${p} is missing`);
// The GKE share preparation: schemas, its own check, and its breaks.
for (const dirs of prepareTargets) {
  const dir = dirs.join(' + ');
  let objs;
  try {
    objs = dirs.flatMap(render);
  } catch (e) {
    fail(`${dir}: kubectl kustomize failed: ${(e.stderr || e.message).toString().slice(0, 2000)}`);
    continue;
  }
  for (const o of objs) {
    const err = await validateSchema(o);
    if (err) fail(`${dir}: ${name(o)} does not validate: ${err}`);
  }
  for (const [check, fn] of Object.entries(PREPARE_CHECKS)) for (const msg of fn(objs)) fail(`${dir}: ${check}: ${msg}`);
  let missed = 0;
  for (const [check, what, mutate] of PREPARE_MUTATIONS) {
    const copy = structuredClone(objs);
    mutate(copy);
    if (!PREPARE_CHECKS[check](copy).length) { missed++; fail(`${dir}: ${check} did not notice: ${what}`); }
  }
  console.log(`${dir}: ${objs.length} objects, ${PREPARE_MUTATIONS.length} deliberate breaks, ${missed ? missed + ' not caught' : 'each caught'}`);
}
for (const n of notes) console.log(`note: ${n}`);
if (!Object.keys(helps).length) console.log('note: no --bin build tree: LLM_* settings not checked against --help');
console.log(failures ? `${failures} failure(s)` : 'all checks passed');
process.exit(failures ? 1 : 0);
