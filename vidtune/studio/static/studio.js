// vidtune studio: the pages' live parts, with plain fetch calls to the studio's JSON actions (no library, nothing
// loaded from the network). Every POST carries the page's secret in a header, which a cross-site form cannot send.
"use strict";

const secret = document.querySelector('meta[name="studio-secret"]').content;

function say(text, isError) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = isError ? "message error" : "message";
  box.hidden = !text;
}

async function post(url, body) {
  const response = await fetch(url, {
    method: "POST",
    headers: {"Content-Type": "application/json", "X-Vidtune-Studio": secret},
    body: JSON.stringify(body),
  });
  const answer = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
  if (!response.ok) {
    say(answer.error || "The studio refused the request.", true);
    throw new Error(answer.error);
  }
  return answer;
}

// Replace the parts of `target` whose HTML changed (a playing video elsewhere keeps playing).
async function refreshParts(url, selector, target) {
  const response = await fetch(url);
  if (!response.ok) return;
  const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
  const now = target.querySelectorAll(selector);
  fresh.body.querySelectorAll(selector).forEach((part, index) => {
    if (!now[index]) target.appendChild(document.importNode(part, true));
    else if (now[index].innerHTML !== part.innerHTML) now[index].replaceWith(document.importNode(part, true));
  });
}

// ----- runs ---------------------------------------------------------------------------------------------------
const actions = {
  async train() {
    const config = document.getElementById("train-config").value;
    const job = await post("/api/train", {config});
    say(`Queued job ${job.id}: ${job.title}.`);
    refreshRunsPage();
  },
  async "stop-job"(button) {
    await post("/api/stop", {job: Number(button.dataset.job)});
    say("Stopping: the run saves a checkpoint after its current step, then exits.");
  },
  async "stop-run"(button) {
    await post("/api/stop", {run: button.dataset.run});
    say("Stopping: the run saves a checkpoint after its current step, then exits.");
  },
  async resume(button) {
    const job = await post("/api/resume", {run: button.dataset.run});
    say(`Queued job ${job.id}: ${job.title}.`);
  },
  async sample(button) {
    const prompt = document.getElementById("sample-prompt").value;
    const job = await post("/api/sample", {run: button.dataset.run, prompt});
    say(`Queued job ${job.id}: ${job.title}; the video appears under Samples.`);
  },
  async export(button) {
    const format = document.getElementById("export-format").value;
    const job = await post("/api/export", {run: button.dataset.run, format});
    say(`Queued job ${job.id}: ${job.title}, into ${job.output}.`);
  },
  // ----- clips ------------------------------------------------------------------------------------------------
  async "save-caption"(button) {
    const card = button.closest(".card");
    const box = card.querySelector("textarea.caption");
    const answer = await post("/api/caption", {
      data: document.getElementById("cards").dataset.data, source: Number(card.dataset.source),
      slot: Number(card.dataset.slot), caption: box.value, previous: box.dataset.previous,
    });
    box.value = answer.caption;
    box.dataset.previous = answer.caption;
    card.classList.add("saved");
    say(`Caption written to ${answer.written}.`);
  },
  async "caption-missing"(button) {
    const job = await post("/api/caption-missing", {data: button.dataset.data});
    say(`Queued job ${job.id}: ${job.title}. Reload the page when it has finished.`);
  },
  // ----- settings ---------------------------------------------------------------------------------------------
  async "save-config"() {
    const answer = await post("/api/save", {file: settingsFile(), values: formValues()});
    say(`Saved ${answer.saved}: run it with vidtune train ${answer.saved}, or start it on the Runs page.`);
  },
  async plan() {
    const gib = Number(document.getElementById("gpu-memory").value);
    document.getElementById("plan-verdict").textContent = "Planning (tracing one step, no weights loaded) ...";
    const answer = await post("/api/plan", {file: settingsFile(), values: formValues(), gpu_memory: gib});
    document.getElementById("plan-verdict").textContent = answer.verdict;
    const list = document.getElementById("plan-overrides");
    list.replaceChildren(...answer.suggested_overrides.map((item) => {
      const line = document.createElement("li");
      line.textContent = item;
      return line;
    }));
    const apply = document.querySelector('[data-action="apply-plan"]');
    apply.hidden = answer.suggested_overrides.length === 0;
    apply.dataset.overrides = JSON.stringify(answer.suggested_overrides);
  },
  async "apply-plan"(button) {
    for (const item of JSON.parse(button.dataset.overrides || "[]")) {
      const at = item.indexOf("=");
      const field = document.querySelector(`[name="${CSS.escape(item.slice(0, at))}"]`);
      if (field) field.value = item.slice(at + 1);
    }
    button.hidden = true;
    await validateForm();
    say("Applied the planner's settings; save the config to keep them.");
  },
};

document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-action]");
  if (!button || !actions[button.dataset.action]) return;
  event.preventDefault();
  button.disabled = true;
  try {
    await actions[button.dataset.action](button);
  } catch (error) {
    // already shown by post()
  } finally {
    button.disabled = false;
  }
});

function refreshRunsPage() {
  refreshParts("/", "table", document.querySelector("main"));
}

// ----- clips page -------------------------------------------------------------------------------------------------
const onlyProblems = document.getElementById("only-problems");
if (onlyProblems) {
  onlyProblems.addEventListener("change", () => {
    document.getElementById("cards").classList.toggle("only-problems", onlyProblems.checked);
  });
}
document.querySelectorAll("details.window").forEach((details) => {
  details.addEventListener("toggle", () => {
    const video = details.querySelector("video");
    if (details.open && !video.getAttribute("src")) video.src = video.dataset.src;
  });
});

// ----- settings page ----------------------------------------------------------------------------------------------
function settingsFile() {
  return document.getElementById("config-file").value;
}

function formValues() {
  const values = {};
  document.querySelectorAll("#settings-form [name]").forEach((field) => {
    if (field.value.trim() !== "") values[field.name] = field.value;
  });
  return values;
}

async function validateForm() {
  const answer = await post("/api/validate", {file: settingsFile(), values: formValues()});
  document.getElementById("validation").textContent = answer.ok ? "Valid: vidtune train runs this config." :
    answer.message;
  document.getElementById("validation").className = answer.ok ? "validation ok" : "validation invalid";
  document.querySelectorAll(".field").forEach((field) => {
    const problems = answer.problems[field.dataset.key] || [];
    field.querySelector(".field-problem").textContent = problems.join("\n");
    field.classList.toggle("invalid", problems.length > 0);
  });
  document.querySelectorAll("[data-family-key]").forEach((note) => {
    const value = answer.family_defaults[note.dataset.familyKey];
    note.textContent = value ? `family default: ${value}` : "";
  });
}

const settingsForm = document.getElementById("settings-form");
if (settingsForm) {
  let timer = null;
  settingsForm.addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => validateForm().catch(() => {}), 400);
  });
  settingsForm.addEventListener("submit", (event) => event.preventDefault());
  // A new file is judged once something is filled in, not as a page of errors on arrival.
  if (!settingsForm.dataset.new) validateForm().catch(() => {});
}

// ----- live refresh -----------------------------------------------------------------------------------------------
const runPanel = document.getElementById("run-panel");
if (runPanel) {
  setInterval(() => {
    refreshParts(`/run/panel?path=${encodeURIComponent(runPanel.dataset.run)}`, "section", runPanel);
  }, 2000);
}
// A run's page opened before its first step (a queued or starting job): look again until the run is there.
if (document.querySelector("#no-run-status[data-waiting]")) {
  setTimeout(() => window.location.reload(), 2000);
}
if (document.body.dataset.page === "runs") {
  setInterval(refreshRunsPage, 3000);
}
