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
    } else if (o.kind === 'Pod') r.push([o, o, true]);
  }
  return r;
}
const containersOf = (t) => [...(t.spec.initContainers || []), ...(t.spec.containers || [])];
const labelsOf = (t) => (t.metadata && t.metadata.labels) || {};
const selects = (sel, labels) =>
  sel && Object.entries(sel.matchLabels || {}).every(([k, v]) => labels[k] === v) && !(sel.matchExpressions || []).length;
const envValue = (c, n) => ((c.env || []).find((e) => e.name === n) || {}).value;
const configMap = (objs, n) => objs.find((o) => o.kind === 'ConfigMap' && o.metadata.name === n);
// The value a container sees for n: env, else a ConfigMap of envFrom.
function envSeen(objs, c, n) {
  const v = envValue(c, n);
  if (v !== undefined) return v;
  for (const f of c.envFrom || []) {
    const cm = f.configMapRef && configMap(objs, f.configMapRef.name);
    if (cm && cm.data && n in cm.data) return cm.data[n];
  }
  return undefined;
}
const program = (c) => (c.command || [])[0];
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
          for (const [probe, path] of [['livenessProbe', '/health'], ['readinessProbe', '/ready']]) {
            const g = c[probe].httpGet || {};
            if (g.path !== path || (g.port !== 'metrics' && g.port !== port))
              f.push(`${where}: ${probe} is not GET ${path} on the metrics port`);
          }
        } else if (/redis/.test(c.image)) {
          for (const probe of ['livenessProbe', 'readinessProbe'])
            if (!JSON.stringify(c[probe].exec || {}).includes('redis-cli ping'))
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
  const ctx = { dir, images: dirs.flatMap(imageEntries) };
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
      if (applies && !applies(copy)) continue;
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
for (const n of notes) console.log(`note: ${n}`);
if (!Object.keys(helps).length) console.log('note: no --bin build tree: LLM_* settings not checked against --help');
console.log(failures ? `${failures} failure(s)` : 'all checks passed');
process.exit(failures ? 1 : 0);
