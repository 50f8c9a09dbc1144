// The review page's only script (the Content-Security-Policy refuses inline ones): the live
// character count under the editor, and polling of /state so that a new pending change or a
// decision made elsewhere (the CLI, a signal, an expiry) shows within a second.
"use strict";

function showCount(textarea, counter) {
  const limit = Number(textarea.dataset.limit);
  const used = textarea.value.length;
  counter.textContent = `${used} characters of Markdown (the block's limit: ${limit}).`;
  counter.classList.toggle("over", used > limit);
}

function watchEditors() {
  for (const counter of document.querySelectorAll("[data-for]")) {
    const textarea = document.getElementById(counter.dataset.for);
    if (!textarea) continue;
    showCount(textarea, counter);
    textarea.addEventListener("input", () => showCount(textarea, counter));
  }
}

function editing() {
  return [...document.querySelectorAll("textarea")].some((t) => t.value !== t.defaultValue);
}

// Memory changed elsewhere: show it, unless that would throw away an edit being typed.
function changed() {
  if (!editing()) {
    window.location.reload();
    return;
  }
  const notice = document.createElement("p");
  notice.id = "changed";
  notice.className = "error";
  notice.textContent = "This memory changed elsewhere: reload to see it (your edit is kept until you do).";
  document.querySelector("main").prepend(notice);
}

async function poll(url) {
  let seen = null;
  for (;;) {
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (response.ok) {
        const state = JSON.stringify(await response.json());
        if (seen !== null && state !== seen) {
          changed();
          return;
        }
        seen = state;
      }
    } catch (error) {
      // the server is away for a moment: try again on the next tick
    }
    await new Promise((resolve) => setTimeout(resolve, 700));
  }
}

document.addEventListener("DOMContentLoaded", () => {
  watchEditors();
  if (document.body.dataset.poll) poll(document.body.dataset.poll);
});
